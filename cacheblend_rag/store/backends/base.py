"""The interface every KV store backend implements (memory, disk, Redis, tiers of them).

A chunk entry is ``num_layers`` layer values (bytes, see :mod:`cacheblend_rag.store.format.chunk_bytes`)
plus one manifest. Writers put every layer first and the manifest last, through
:meth:`KVStore.add_manifest`, which writes only if no manifest exists yet. So:

* a chunk is visible only once complete;
* layer values are named by ``(key, write_id, layer)``, with a fresh ``write_id`` per write,
  so two processes writing the same chunk at once never overwrite each other's layers;
  the first manifest wins and the loser deletes its own layers;
* a reader that finds a manifest knows which layer values belong to it.

Backends only move bytes. They never decode, never pickle, and signal I/O failure with
:class:`~cacheblend_rag.store.errors.StoreError` (or any ``OSError``); the chunk cache
above them treats that as a miss, computes fresh and warns.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

from cacheblend_rag.store.errors import CorruptEntryError

COUNTERS = ("hits", "misses", "load_failures", "evictions", "corrupt", "foreign_key_entries")


@dataclass
class StoreStats:
    """Chunk-level counts. ``hits`` count chunks whose stored KV a blend used; ``misses`` chunks it
    found no valid entry of; ``load_failures`` chunks whose entry was found but could not be read
    whole (the store failed, a layer was evicted or damaged), so they were recomputed; ``corrupt``
    counts entries found damaged (and deleted); ``foreign_key_entries`` entries found written under another
    store key than the reader's (or none where it has one, or one where it has none): not used, never
    deleted, their chunks computed fresh; each such chunk a blend asked for is also one of its ``misses``,
    so hits + misses + load failures still add up to the chunks asked for. ``bytes`` is the space used.

    ``available`` is false when the store could not be asked (``error`` says why; the counts are then
    what this process knows). ``writes_skipped`` counts chunk writes this process skipped because
    the store takes no writes for now (a full disk, a read-only file system); ``write_backs_dropped`` the
    missed chunks this process did not write back because its write-back queue was full (a slow store)."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    load_failures: int = 0
    evictions: int = 0
    corrupt: int = 0
    foreign_key_entries: int = 0
    available: bool = True
    error: str | None = None
    writes_skipped: int = 0
    write_backs_dropped: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class KVStore(ABC):
    """Byte storage of chunk KV, one value per layer plus a manifest per chunk. Thread-safe."""

    def __init__(self) -> None:
        self._counter_lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------ layers
    @abstractmethod
    def get_layer(self, key: str, write_id: str, layer: int) -> bytes | None:
        """The value of one layer, or ``None`` if absent."""

    def get_layers(self, requests: Sequence[tuple[str, str, int]]) -> list[bytes | None]:
        """Several ``(key, write_id, layer)`` values at once; backends with round trips batch them."""
        return [self.get_layer(key, write_id, layer) for key, write_id, layer in requests]

    @abstractmethod
    def put_layer(self, key: str, write_id: str, layer: int, data: bytes) -> None:
        """Store one layer value (overwriting the same name)."""

    @abstractmethod
    def delete_layers(self, key: str, write_id: str, num_layers: int) -> None:
        """Remove the layer values of one write (a writer that lost the race cleans up with this)."""

    # --------------------------------------------------------- manifests
    @abstractmethod
    def get_manifest(self, key: str) -> bytes | None:
        """The manifest of a chunk, or ``None`` if the chunk is absent or incomplete."""

    def get_manifests(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get_manifest(key) for key in keys]

    @abstractmethod
    def add_manifest(self, key: str, data: bytes) -> bool:
        """Atomically store the manifest unless one exists; ``True`` if this call stored it."""

    def contains(self, key: str) -> bool:
        return self.get_manifest(key) is not None

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove a chunk: its manifest first (so readers stop seeing it), then all its layer values."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Keys of the chunks that have a manifest."""

    def manifests(self) -> Iterator[tuple[str, Any]]:
        """``(key, manifest value)`` of every chunk, as stored (unchecked): for inventories."""
        for key in self.keys():
            try:
                yield key, self.get_manifest(key)
            except CorruptEntryError as exc:
                yield key, exc

    # ------------------------------------------------------------- admin
    def bind_model(self, fingerprint: str, *, max_value_bytes: int | None = None) -> None:
        """Called by :class:`~cacheblend_rag.store.ChunkCache` with its model's fingerprint and the
        largest value that model can have (a layer of its longest chunk at 32 bits).

        Chunk keys already embed the fingerprint; a backend may also group its keys by it
        (Redis namespaces them, so one model's entries can be listed or cleared alone). A backend
        that reads values from files refuses to read more than ``max_value_bytes`` (raising
        :class:`CorruptEntryError`), so a forged size cannot exhaust memory.
        """
        if max_value_bytes is not None:
            self.max_value_bytes = max(getattr(self, "max_value_bytes", 0) or 0, int(max_value_bytes))

    max_value_bytes: int | None = None

    @property
    def shared(self) -> bool:
        """Whether other processes (and whoever can write where it lives) can write this store: anything but
        process memory. Opened without a store key, such a store accepts any self-consistent entry planted
        in it, so :class:`~cacheblend_rag.store.ChunkCache` warns once (``require_store_key`` refuses)."""
        return True

    def record(self, **counts: int) -> None:
        """Add to the counters named in ``COUNTERS`` (persistent backends persist them)."""
        unknown = set(counts) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}; known counters are {COUNTERS}")
        with self._counter_lock:
            for name, n in counts.items():
                self._counters[name] += int(n)

    def counters(self) -> dict[str, int]:
        with self._counter_lock:
            return dict(self._counters)

    def reset_counters(self) -> None:
        with self._counter_lock:
            self._counters = dict.fromkeys(COUNTERS, 0)

    @abstractmethod
    def stats(self) -> StoreStats: ...

    @abstractmethod
    def clear(self) -> None:
        """Remove every entry and reset the counters."""

    def close(self) -> None:  # noqa: B027 (optional: a store holding nothing open has nothing to release)
        """Release files or connections. The store is unusable afterwards."""

    def describe(self) -> str:
        """A short human-readable location, for logs and the CLI."""
        return type(self).__name__

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self.describe()}>"
