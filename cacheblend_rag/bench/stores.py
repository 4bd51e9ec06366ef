"""Chunk stores for a benchmark run: a fresh, empty :class:`ChunkCache` per question and prefix variant.

A fresh store per question keeps memory bounded (SmolLM2 keeps ~46 KB of float32 KV per token;
ten 550-token passages are ~250 MB) and makes the cold pass honest: nothing another question
computed can be hit.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, Sequence

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import ChunkCache

logger = logging.getLogger(__name__)

StoreKind = Literal["memory", "disk"]


def _backend_classes() -> tuple[Any, Any]:
    """``(MemoryKVStore, DiskKVStore)``, or ``None`` for those this install does not have."""
    import cacheblend_rag.store as store_module

    return getattr(store_module, "MemoryKVStore", None), getattr(store_module, "DiskKVStore", None)


class ChunkStoreFactory:
    """Opens empty chunk caches on one backend kind; :meth:`close` releases everything it opened."""

    def __init__(self, kind: StoreKind, engine: Any, directory: str | Path | None = None) -> None:
        if kind not in ("memory", "disk"):
            raise ConfigError(f"--store {kind!r} is not supported; choose 'memory' or 'disk'")
        self.kind = kind
        self.engine = engine
        memory_cls, disk_cls = _backend_classes()
        if kind == "disk" and disk_cls is None:
            raise ConfigError(
                "--store disk needs cacheblend_rag.store.DiskKVStore, which this install does not have; "
                "use --store memory"
            )
        self._memory_cls = memory_cls
        self._disk_cls = disk_cls
        self._root = Path(tempfile.mkdtemp(prefix="cacheblend-bench-", dir=directory))
        self._opened = 0
        self._stores: dict[int, tuple[Any, Path | None]] = {}

    @property
    def backend_name(self) -> str:
        cls = self._disk_cls if self.kind == "disk" else self._memory_cls
        return cls.__name__ if cls is not None else "ChunkCache (built-in in-memory dict)"

    def open(self, prefix_ids: Sequence[int] = ()) -> ChunkCache:
        """A new, empty chunk cache whose chunks are precomputed behind ``prefix_ids``."""
        self._opened += 1
        path: Path | None = None
        if self.kind == "disk":
            path = self._root / f"store-{self._opened}"
            store = self._disk_cls(path)
        else:
            store = self._memory_cls() if self._memory_cls is not None else None
        cache = ChunkCache(self.engine, store, prefix_ids=prefix_ids)
        self._stores[id(cache)] = (store, path)
        return cache

    def release(self, cache: ChunkCache) -> None:
        """Drop one cache and its storage."""
        store, path = self._stores.pop(id(cache), (None, None))
        close = getattr(store, "close", None)
        if callable(close):
            close()
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        for key in list(self._stores):
            store, path = self._stores.pop(key)
            close = getattr(store, "close", None)
            if callable(close):
                close()
        shutil.rmtree(self._root, ignore_errors=True)
