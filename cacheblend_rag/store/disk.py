"""DiskKVStore: chunk KV in a local directory, on diskcache (SQLite index + one file per large value).

diskcache gives process-safe, atomic reads and writes: several processes may warm and read
the same directory at once. Two things are done here instead of by diskcache:

* **Eviction is per chunk.** diskcache would evict single values, leaving chunks with holes;
  this store evicts the oldest whole chunks (manifest first, then its layers, found by tag)
  once the volume passes ``size_limit``, and counts each eviction.
* **Nothing is ever unpickled.** Only ``bytes`` are stored, and a custom ``Disk`` refuses to
  load a pickled value that some other program may have put in the directory.

Counters (hits, misses, evictions, corrupt) live in a small second cache, ``<path>/counters``,
so every process adds to the same totals and ``cacheblend-rag cache stats`` can show them.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import diskcache
from diskcache.core import MODE_PICKLE

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.base import COUNTERS, KVStore, StoreStats
from cacheblend_rag.store.errors import CorruptEntryError, StoreError

_IO_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
# diskcache's own size limit is disabled; this store enforces ``size_limit`` chunk by chunk.
_NO_LIMIT = 2**62
# Layer values above this size go to their own files, whose space is returned when they are
# evicted; values inside SQLite leave free pages behind and the database file never shrinks.
_MIN_FILE_SIZE = 4096


class _BytesOnlyDisk(diskcache.Disk):
    """diskcache serialization that stores bytes (and counter ints) raw and never unpickles."""

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN):
        if type(value) not in (bytes, int):
            raise TypeError(f"the KV store stores bytes only, got {type(value).__name__}")
        return super().store(value, read, key=key)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool):
        if mode == MODE_PICKLE:
            raise CorruptEntryError("a value in the store directory is pickled; refusing to unpickle it")
        return super().fetch(mode, filename, value, read)

    def get(self, key: Any, raw: bool):
        if not raw:
            return None  # a pickled key was written by another program; never unpickle it
        return super().get(key, raw)


def _manifest_name(key: str) -> str:
    return f"m:{key}"


def _layer_name(key: str, write_id: str, layer: int) -> str:
    return f"l:{key}:{write_id}:{layer}"


class DiskKVStore(KVStore):
    """Chunk KV under ``path``; at most about ``size_limit`` bytes (``None``: unbounded).

    The limit is enforced after each chunk is written, so the volume can pass it by at most
    the chunks being written at that moment.
    """

    def __init__(self, path: str | Path, *, size_limit: int | None = None, timeout: float = 60.0) -> None:
        super().__init__()
        if size_limit is not None and (isinstance(size_limit, bool) or not isinstance(size_limit, int) or size_limit < 1):
            raise ConfigError(f"size_limit={size_limit!r} must be a positive number of bytes, or None for no limit")
        self.path = Path(path).expanduser()
        self.size_limit = size_limit
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._cache = diskcache.Cache(
                str(self.path), disk=_BytesOnlyDisk, size_limit=_NO_LIMIT, eviction_policy="none",
                tag_index=True, statistics=False, timeout=timeout, disk_min_file_size=_MIN_FILE_SIZE,
            )
            self._counter_cache = diskcache.Cache(
                str(self.path / "counters"), disk=_BytesOnlyDisk, size_limit=_NO_LIMIT, eviction_policy="none",
                timeout=timeout,
            )
        except _IO_ERRORS as exc:
            raise StoreError(
                f"cannot open the disk KV store at {self.path}: {exc}. Check that the directory can be "
                "created and written, or pass another path"
            ) from exc

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        try:
            yield
        except _IO_ERRORS as exc:
            raise StoreError(f"disk KV store at {self.path}: cannot {what}: {exc}") from exc

    # ------------------------------------------------------------ layers
    def get_layer(self, key: str, write_id: str, layer: int) -> bytes | None:
        with self._io("read a layer"):
            return self._cache.get(_layer_name(key, write_id, layer), default=None, retry=True)

    def put_layer(self, key: str, write_id: str, layer: int, data: bytes) -> None:
        with self._io("write a layer"):
            self._cache.set(_layer_name(key, write_id, layer), bytes(data), tag=key, retry=True)

    def delete_layers(self, key: str, write_id: str, num_layers: int) -> None:
        with self._io("delete layers"):
            for layer in range(num_layers):
                self._cache.delete(_layer_name(key, write_id, layer), retry=True)

    # --------------------------------------------------------- manifests
    def get_manifest(self, key: str) -> bytes | None:
        with self._io("read a manifest"):
            return self._cache.get(_manifest_name(key), default=None, retry=True)

    def add_manifest(self, key: str, data: bytes) -> bool:
        with self._io("write a manifest"):
            added = self._cache.add(_manifest_name(key), bytes(data), tag=key, retry=True)
        if added:
            self._evict_to_limit()
        return added

    def contains(self, key: str) -> bool:
        with self._io("look up a manifest"):
            return _manifest_name(key) in self._cache

    def delete(self, key: str) -> bool:
        with self._io("delete a chunk"):
            removed = self._cache.delete(_manifest_name(key), retry=True)
            self._cache.evict(key, retry=True)  # every value tagged with the key: all writes' layers
        return removed

    def keys(self) -> Iterator[str]:
        with self._io("list keys"):
            names = list(self._cache.iterkeys())
        return (name[2:] for name in names if isinstance(name, str) and name.startswith("m:"))

    # ----------------------------------------------------------- eviction
    def volume(self) -> int:
        with self._io("measure its size"):
            return self._cache.volume()

    def _evict_to_limit(self) -> None:
        if self.size_limit is None:
            return
        with self._io("evict"):
            while self._cache.volume() > self.size_limit:
                try:
                    (name, _), tag = self._cache.peekitem(last=False, tag=True, retry=True)
                except KeyError:
                    return  # empty: what is left is SQLite's own pages
                except CorruptEntryError:
                    return
                if tag:
                    if self.delete(tag):
                        self.record(evictions=1)
                else:
                    self._cache.delete(name, retry=True)

    # ------------------------------------------------------------- admin
    def record(self, **counts: int) -> None:
        unknown = set(counts) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}; known counters are {COUNTERS}")
        with self._io("update its counters"):
            for name, n in counts.items():
                if n:
                    self._counter_cache.incr(name, int(n), default=0, retry=True)

    def counters(self) -> dict[str, int]:
        with self._io("read its counters"):
            return {name: int(self._counter_cache.get(name, default=0, retry=True)) for name in COUNTERS}

    def reset_counters(self) -> None:
        with self._io("reset its counters"):
            self._counter_cache.clear(retry=True)

    def stats(self) -> StoreStats:
        entries = sum(1 for _ in self.keys())
        return StoreStats(
            entries=entries, bytes=self.volume(), **self.counters(),
            details={"path": str(self.path), "size_limit": self.size_limit},
        )

    def clear(self) -> None:
        with self._io("clear"):
            self._cache.clear(retry=True)
        self.reset_counters()

    def close(self) -> None:
        self._cache.close()
        self._counter_cache.close()

    def describe(self) -> str:
        limit = "" if self.size_limit is None else f", size_limit={self.size_limit}"
        return f"DiskKVStore({str(self.path)!r}{limit})"
