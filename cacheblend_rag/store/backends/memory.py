"""MemoryKVStore: chunk entries in process memory, evicted least-recently-used, a whole chunk at a time."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator, Literal

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.backends.base import KVStore, StoreStats
from cacheblend_rag.store.backends.memory_budget import default_memory_store_bytes


class _Entry:
    __slots__ = ("manifest", "layers", "nbytes")

    def __init__(self) -> None:
        self.manifest: bytes | None = None
        self.layers: dict[tuple[str, int], bytes] = {}
        self.nbytes = 0


class MemoryKVStore(KVStore):
    """LRU over chunks, bounded by ``max_bytes`` of stored values: ``"auto"`` (the default) is an eighth of
    the memory this process may use, at most 4 GiB (:mod:`~cacheblend_rag.store.backends.memory_budget` says why);
    ``None``: unbounded, for a caller who bounds it otherwise.

    Values stay encoded (the same bytes a disk or Redis store holds), so a memory hit still
    verifies checksums and converts to the compute dtype; what it saves is the I/O.
    """

    shared = False  # this process's own memory: no one else writes it

    def __init__(self, max_bytes: int | None | Literal["auto"] = "auto") -> None:
        super().__init__()
        if max_bytes == "auto":
            max_bytes = default_memory_store_bytes()
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ConfigError(f"max_bytes={max_bytes!r} must be a positive number of bytes, 'auto' for the "
                              "default bound, or None for no limit")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------ layers
    def get_layer(self, key: str, write_id: str, layer: int) -> bytes | None:
        with self._lock:
            entry = self._entries.get(key)
            data = None if entry is None else entry.layers.get((write_id, layer))
            if data is not None:
                self._entries.move_to_end(key)
            return data

    def put_layer(self, key: str, write_id: str, layer: int, data: bytes) -> None:
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            old = entry.layers.get((write_id, layer))
            entry.layers[(write_id, layer)] = bytes(data)
            self._resize(entry, len(data) - (len(old) if old is not None else 0))
            self._entries.move_to_end(key)
            self._evict(protect=key)  # the chunk being written is not complete yet

    def delete_layers(self, key: str, write_id: str, num_layers: int) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            for layer in range(num_layers):
                old = entry.layers.pop((write_id, layer), None)
                if old is not None:
                    self._resize(entry, -len(old))
            if not entry.layers and entry.manifest is None:
                del self._entries[key]

    # --------------------------------------------------------- manifests
    def get_manifest(self, key: str) -> bytes | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.manifest is None:
                return None
            self._entries.move_to_end(key)
            return entry.manifest

    def add_manifest(self, key: str, data: bytes) -> bool:
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            if entry.manifest is not None:
                return False
            entry.manifest = bytes(data)
            self._resize(entry, len(data))
            self._entries.move_to_end(key)
            self._evict()
            return True

    def contains(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.manifest is not None

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._bytes -= entry.nbytes
            return entry.manifest is not None

    def keys(self) -> Iterator[str]:
        with self._lock:
            keys = [k for k, e in self._entries.items() if e.manifest is not None]
        return iter(keys)

    # ------------------------------------------------------------- admin
    def _resize(self, entry: _Entry, delta: int) -> None:
        entry.nbytes += delta
        self._bytes += delta

    def _evict(self, protect: str | None = None) -> None:
        if self.max_bytes is None:
            return
        while self._bytes > self.max_bytes:
            victim = next((k for k in self._entries if k != protect), None)
            if victim is None:
                return
            entry = self._entries.pop(victim)
            self._bytes -= entry.nbytes
            if entry.manifest is not None:
                self.record(evictions=1)

    def stats(self) -> StoreStats:
        with self._lock:
            entries = sum(1 for e in self._entries.values() if e.manifest is not None)
            used = self._bytes
        return StoreStats(entries=entries, bytes=used, **self.counters(), details={"max_bytes": self.max_bytes})

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
        self.reset_counters()

    def describe(self) -> str:
        limit = "unbounded" if self.max_bytes is None else f"max_bytes={self.max_bytes}"
        return f"MemoryKVStore({limit})"
