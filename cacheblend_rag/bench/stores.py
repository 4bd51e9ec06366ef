"""Chunk stores for a benchmark run: a fresh, empty :class:`ChunkCache` per question and prefix variant,
or one persistent disk store that every question and every later run shares.

A fresh store per question keeps memory and disk bounded (SmolLM2 keeps ~23 KB of 16-bit KV
per token; ten 550-token passages are ~125 MB) and makes the cold pass honest: nothing
another question computed can be hit.

A persistent store (``--store disk:PATH``) is for the research loop: chunk keys hold the model
fingerprint, the chunk's token ids, its conditioning prefix and a lossy codec, so a rerun on the
same model finds every chunk and computes none. Lossless codecs share keys (a reader takes a
float16 entry for a float32 one), so each ``storage_dtype`` gets its own folder under PATH: a
run at float32 never blends chunks an earlier run stored at 16 bits. The cold pass still gets a
fresh, empty store.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, Sequence

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import ChunkCache, DiskKVStore, KVStore, MemoryKVStore
from cacheblend_rag.store.format.codec import STORAGE_DTYPES

StoreKind = Literal["memory", "disk"]


class ChunkStoreFactory:
    """Opens empty chunk caches on one backend kind; :meth:`close` releases everything it opened."""

    def __init__(
        self, kind: StoreKind, engine: Any, directory: str | Path | None = None, storage_dtype: str = "auto",
        persistent: str | Path | None = None,
    ) -> None:
        if kind not in ("memory", "disk"):
            raise ConfigError(f"store={kind!r} is not supported; choose 'memory' or 'disk'")
        if storage_dtype not in STORAGE_DTYPES:
            raise ConfigError(f"storage_dtype={storage_dtype!r}; choose one of {', '.join(STORAGE_DTYPES)}")
        self.kind = kind
        self.engine = engine
        self.storage_dtype = storage_dtype
        self._root = Path(tempfile.mkdtemp(prefix="cacheblend-bench-", dir=directory)) if kind == "disk" else None
        self._opened = 0
        self._open: dict[int, tuple[ChunkCache, KVStore | None, Path | None]] = {}
        if persistent is not None and kind != "disk":
            raise ConfigError(f"a persistent chunk store ({persistent}) is a disk store; got store={kind!r}")
        self.persistent = Path(persistent).expanduser() if persistent is not None else None
        self._shared: dict[str, DiskKVStore] = {}  # storage dtype -> the persistent store holding it

    @property
    def backend_name(self) -> str:
        return (DiskKVStore if self.kind == "disk" else MemoryKVStore).__name__

    def open(self, prefix_ids: Sequence[int] = (), storage_dtype: str | None = None, *,
             empty: bool = False) -> ChunkCache:
        """A chunk cache whose :meth:`~ChunkCache.warm` computes chunks behind ``prefix_ids``, storing
        them as ``storage_dtype`` (default: the factory's): on the persistent store if there is one
        (unless ``empty``), else on a new, empty store."""
        dtype = storage_dtype or self.storage_dtype
        if self.persistent is not None and not empty:
            if dtype not in self._shared:
                self._shared[dtype] = DiskKVStore(self.persistent / dtype)
            cache = ChunkCache(self.engine, self._shared[dtype], prefix_ids=prefix_ids, storage_dtype=dtype,
                               resident_bytes=0)  # the store is what is measured, never a tier in front of it
            self._open[id(cache)] = (cache, None, None)  # the store outlives the cache, and the run
            return cache
        self._opened += 1
        path: Path | None = None
        if self.kind == "disk":
            assert self._root is not None
            path = self._root / f"store-{self._opened}"
            store: KVStore = DiskKVStore(path)
        else:
            store = MemoryKVStore()
        cache = ChunkCache(self.engine, store, prefix_ids=prefix_ids, storage_dtype=dtype, resident_bytes=0)
        self._open[id(cache)] = (cache, store, path)
        return cache

    def release(self, cache: ChunkCache) -> None:
        """Finish the cache's background writes, then drop it and its storage."""
        entry = self._open.pop(id(cache), None)
        if entry is not None:
            self._dispose(*entry)

    def close(self) -> None:
        for key in list(self._open):
            self._dispose(*self._open.pop(key))
        for store in self._shared.values():
            store.close()
        self._shared.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    @staticmethod
    def _dispose(cache: ChunkCache, store: KVStore | None, path: Path | None) -> None:
        cache.close()
        if store is not None:
            store.close()
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
