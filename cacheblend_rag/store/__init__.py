"""Chunk KV storage. (Issue 3 builds the persistent backends; this is the contract the engine and integrations use.)"""

from cacheblend_rag.store.chunk_cache import ChunkCache, WarmSummary

__all__ = ["ChunkCache", "WarmSummary"]
