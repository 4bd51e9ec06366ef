"""cacheblend-rag: faster RAG answers by blending precomputed chunk KV caches (CacheBlend)."""

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import (
    BlendResult,
    BlendStats,
    CacheBlendEngine,
    CachedSegment,
    ChunkKV,
    FreshSegment,
    GenerationResult,
    StoredSegment,
)
from cacheblend_rag.errors import (
    BlendInputError,
    CacheBlendError,
    ChunkMismatchError,
    ConfigError,
    CorrectnessGateError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from cacheblend_rag.models import load_model

__version__ = "0.1.0"

__all__ = [
    "BlendConfig", "BlendInputError", "BlendResult", "BlendStats", "CacheBlendEngine", "CacheBlendError",
    "CachedSegment", "ChunkKV", "ChunkMismatchError", "ConfigError", "CorrectnessGateError", "FreshSegment",
    "GenerationConfig", "GenerationResult", "ModelLoadError", "StoredSegment", "UnsupportedArchitectureError",
    "load_model", "__version__",
]
