"""The blending engine: chunk precompute, blend with selective recompute, generation."""

from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.engine.generate import GenerationResult, GenerationStream
from cacheblend_rag.kv.source import CachedKVSource, InMemoryKVSource, KVSourceProvider
from cacheblend_rag.engine.results import BlendResult, BlendStats
from cacheblend_rag.kv.segments import CachedSegment, ChunkKV, FreshSegment, PrefixSegment, StoredSegment
from cacheblend_rag.engine.selection import (
    SelectionStrategy,
    available_strategies,
    build_strategy,
    get_strategy,
    register_strategy,
)

__all__ = [
    "BlendResult", "BlendStats", "CacheBlendEngine", "CachedKVSource", "CachedSegment", "ChunkKV",
    "FreshSegment", "GenerationResult", "GenerationStream", "InMemoryKVSource", "KVSourceProvider", "PrefixSegment",
    "SelectionStrategy", "StoredSegment", "available_strategies", "build_strategy", "get_strategy",
    "register_strategy",
]
