"""Verified chunk KV kept in host memory, in front of a store.

A blend on a GPU reads each stored chunk's every layer as its own store entry: an index lookup, a file,
a checksum and a finite check each. On an H200 that cost a 3,000-token blend of a 1.5B model ~250 ms of
host time against 25 ms for the whole full prefill (docs/performance.md, GPU), while the bytes
themselves would cross PCIe in ~2 ms. :class:`ResidentChunks` keeps a chunk, once it has been read and
verified (or computed here), as two tensors ``[layers, kv_heads, tokens, head_dim]`` in the engine's
dtype, page-locked for a CUDA engine, so that a later blend copies it layer by layer with no store
access at all: LMCache's CPU-memory tier, in front of our disk, memory or Redis store. Nothing here
ever came from outside the process unverified, so nothing here is checked again.

A stored chunk becomes resident after the blend that first used it: the cache's writer thread reads it
once more, whole (the blend itself may have skipped layers), off the blend's path. A chunk that could
never fit is not read for it. A working set larger than the bound makes every blend's chunks be read
again in the background as they come and go, as any cache that thrashes would.

Bounded by bytes, least recently used first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from cacheblend_rag.errors import ConfigError

DEFAULT_CUDA_BYTES = 2 << 30


@dataclass(frozen=True)
class ResidentChunk:
    """One chunk's K and V, ``[layers, kv_heads, tokens, head_dim]`` each; ``exact``: equal to what the
    engine computes (not expanded from a lossy codec); ``nbytes``: the host memory it holds."""

    keys: torch.Tensor
    values: torch.Tensor
    exact: bool
    nbytes: int


def resident_budget(max_bytes: int | None, device: torch.device) -> int:
    """``max_bytes`` checked; ``None`` is the device's default: none on a CPU, where a blend's own
    arithmetic hides the store's reads, and 2 GiB of page-locked memory for a CUDA engine."""
    if max_bytes is None:
        return DEFAULT_CUDA_BYTES if device.type == "cuda" else 0
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ConfigError(f"resident_bytes={max_bytes!r} must be a number of bytes (0 turns the host-memory tier "
                          "off), or None for the device's default")
    return max_bytes


class ResidentChunks:
    """Chunk key -> :class:`ResidentChunk`, at most ``max_bytes`` of them. Thread-safe."""

    def __init__(self, max_bytes: int, *, pin: bool) -> None:
        self.max_bytes = max_bytes
        self.pin = pin
        self._chunks: OrderedDict[str, ResidentChunk] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: str) -> ResidentChunk | None:
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is not None:
                self._chunks.move_to_end(key)
                self.hits += 1
            return chunk

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._chunks

    def footprint(self, nbytes: int) -> int:
        """Host memory an allocation of ``nbytes`` holds: torch's page-locked allocator rounds each up to a
        power of two, so the bound counts what is really held, not what the tensors need."""
        return 1 << max(nbytes - 1, 0).bit_length() if self.pin else nbytes

    def host_copy(self, keys: list[torch.Tensor], values: list[torch.Tensor], dtype: torch.dtype,
                  exact: bool) -> ResidentChunk:
        """Per-layer K and V (anywhere, any dtype) stacked into one host allocation, page-locked when this
        tier pins."""
        both = torch.empty((2, len(keys), *keys[0].shape), dtype=dtype, pin_memory=self.pin)
        for i, (k, v) in enumerate(zip(keys, values)):
            both[0, i].copy_(k)
            both[1, i].copy_(v)
        return ResidentChunk(both[0], both[1], exact, self.footprint(both.numel() * both.element_size()))

    def put(self, key: str, chunk: ResidentChunk) -> bool:
        """Keep ``chunk`` (the least recently used go to make room); ``False`` if it alone is over the bound."""
        size = chunk.nbytes
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._chunks and self._bytes + size > self.max_bytes:
                _, evicted = self._chunks.popitem(last=False)
                self._bytes -= evicted.nbytes
            self._chunks[key] = chunk
            self._bytes += size
        return True

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._chunks), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits}
