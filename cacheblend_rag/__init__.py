"""cacheblend-rag: faster RAG answers by blending precomputed chunk KV caches (CacheBlend)."""

import os

# oneDNN (bfloat16 matmuls on a CPU) keeps the kernels it builds for each new matrix shape, 1,024 by
# default, about 2 MB apiece on SmolLM2 (a few per new prompt length): a server's memory grew 1-3 MB/s
# in a soak as prompt lengths varied. 64 keeps a decode batch's shapes hot and bounds the rest; no
# prefill was slower for it (docs/operations.md, "Sizing"). Read when oneDNN builds its first kernel,
# so setting it here works even after torch is imported; a value already set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
# torch's oneDNN bridge (ideep) keeps its own cache of each matmul's setup per shape, beside oneDNN's,
# also 1,024 entries by default (``LRU_CACHE_CAPACITY``), 0.3-0.9 MB each in bfloat16: with oneDNN's
# capped, RSS still grew ~0.2 MB/s in a ten-minute soak, the glibc heap of the thread that runs the
# model gaining ~65 MB of live blocks in four minutes. 64 bounded it (a bfloat16 linear over 200 new
# lengths: +71 MB then flat, against +186 MB and rising); read at the cache's first use, like the above.
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

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
    ContextWindowError,
    CorrectnessGateError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from cacheblend_rag.models import load_model

def _installed_version() -> str:
    # The installed distribution's metadata, so the version is written once (pyproject.toml); a source tree
    # used without installing has none.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cacheblend-rag")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "BlendConfig", "BlendInputError", "BlendResult", "BlendStats", "CacheBlendEngine", "CacheBlendError",
    "CachedSegment", "ChunkKV", "ChunkMismatchError", "ConfigError", "ContextWindowError", "CorrectnessGateError", "FreshSegment",
    "GenerationConfig", "GenerationResult", "ModelLoadError", "StoredSegment", "UnsupportedArchitectureError",
    "load_model", "__version__",
]
