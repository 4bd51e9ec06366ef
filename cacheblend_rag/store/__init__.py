"""Chunk KV storage: content-addressed, checksummed, per-layer values in memory, on disk, or tiered.

Most users need only :class:`ChunkCache` (what ``engine.blend(store=...)`` and the
integrations talk to) and :func:`open_store`.
"""

from cacheblend_rag.store.backends.base import KVStore, StoreStats
from cacheblend_rag.store.chunk_cache import ChunkCache
from cacheblend_rag.store.chunk_warm import WarmSummary
from cacheblend_rag.store.backends.disk import DiskKVStore
from cacheblend_rag.store.errors import CorruptEntryError, StoreError
from cacheblend_rag.store.factory import open_store, parse_size, register_store_scheme
from cacheblend_rag.store.format.keys import chunk_key
from cacheblend_rag.store.loader import PipelinedKVSource
from cacheblend_rag.store.backends.memory import MemoryKVStore
from cacheblend_rag.store.backends.tiered import TieredKVStore

__all__ = [
    "ChunkCache", "CorruptEntryError", "DiskKVStore", "KVStore", "MemoryKVStore", "PipelinedKVSource", "StoreError",
    "StoreStats", "TieredKVStore", "WarmSummary", "chunk_key", "open_store", "parse_size", "register_store_scheme",
]
