"""Verified chunk KV kept in host memory, in front of a store.

A blend on a GPU reads each stored chunk's every layer as its own store entry: an index lookup, a file,
a checksum and a finite check each. On an H200 that cost a 3,000-token blend of a 1.5B model ~250 ms of
host time against 25 ms for the whole full prefill (docs/performance.md, GPU), while the bytes
themselves would cross PCIe in ~2 ms. :class:`ResidentChunks` keeps a chunk, once it has been read and
verified (or computed here), as two tensors ``[layers, kv_heads, tokens, head_dim]`` in the engine's
dtype, page-locked for a CUDA engine, so that a later blend copies it layer by layer with no store
access at all: LMCache's CPU-memory tier, in front of our disk, memory or Redis store. Nothing here
ever came from outside the process unverified, so nothing here is checked again.

A stored chunk becomes resident from the blend that first reads it: the loader keeps the layers it read
and checked (references to the bytes, no copy on the blend's path), and when the blend is done the cache's
writer thread copies them into the chunk's host allocation (a :class:`Capture`) and reads only the layers
the blend skipped (a deviation blend starts at its check layer). A chunk that could never fit is not kept.

Bounded by bytes, least recently used first.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.backends.memory_budget import usable_memory

DEFAULT_CUDA_BYTES = 2 << 30
DEFAULT_CPU_BYTES = 1 << 30


@dataclass(frozen=True)
class ResidentChunk:
    """One chunk's K and V, ``[layers, kv_heads, tokens, head_dim]`` each; ``exact``: equal to what the
    engine computes (not expanded from a lossy codec); ``nbytes``: the host memory it holds."""

    keys: torch.Tensor
    values: torch.Tensor
    exact: bool
    nbytes: int


class Capture:
    """A chunk's host allocation, filled layer by layer (on the cache's writer thread) before it is kept."""

    def __init__(self, both: torch.Tensor, nbytes: int, exact: bool) -> None:
        self.both = both  # [2 (K, V), layers, kv_heads, tokens, head_dim]
        self.nbytes = nbytes
        self.exact = exact
        self.layers: set[int] = set()

    def add(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.both[0, index].copy_(keys)
        self.both[1, index].copy_(values)
        self.layers.add(index)

    def missing(self) -> list[int]:
        return [i for i in range(self.both.shape[1]) if i not in self.layers]

    def chunk(self) -> ResidentChunk:
        return ResidentChunk(self.both[0], self.both[1], self.exact, self.nbytes)


def resident_budget(max_bytes: int | None, device: torch.device) -> int:
    """``max_bytes`` checked; ``None`` is the device's default: 2 GiB of page-locked memory for a CUDA engine;
    on a CPU 1 GiB, or a sixteenth of the memory this process may use (memory_budget.usable_memory: the machine's,
    or its cgroup's limit) where that is less. A CPU blend hides the wait for the
    store's reads behind its arithmetic, but not their cost: the loader thread's index lookups, reads, checksums
    and finite checks (280 entries for 10 chunks of a 28-layer model) take cores the blend's matrix products
    need. The agentic-RAG answering call (10 passages of 300 tokens, bfloat16, a 2-core Xeon with AMX, variants
    interleaved in one process) took 2.81 s from the disk store and 2.71 s from this tier on Qwen2.5-Coder-1.5B,
    0.71 s and 0.67 s on SmolLM2."""
    if max_bytes is None:
        return DEFAULT_CUDA_BYTES if device.type == "cuda" else min(DEFAULT_CPU_BYTES, usable_memory() // 16)
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

    def capture(self, num_layers: int, shape: tuple[int, int, int], dtype: torch.dtype, exact: bool) -> Capture | None:
        """An empty host allocation for a chunk of ``num_layers`` layers of K and V ``shape`` (kv_heads,
        tokens, head_dim), page-locked when this tier pins; ``None`` if such a chunk could never be kept."""
        size = 2 * num_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.footprint(size) > self.max_bytes:
            return None
        both = torch.empty((2, num_layers, *shape), dtype=dtype, pin_memory=self.pin)
        return Capture(both, self.footprint(size), exact)

    def host_copy(self, keys: list[torch.Tensor], values: list[torch.Tensor], dtype: torch.dtype,
                  exact: bool) -> ResidentChunk | None:
        """Per-layer K and V (anywhere, any dtype) in one host allocation; ``None`` if it could never be kept."""
        held = self.capture(len(keys), tuple(keys[0].shape), dtype, exact)
        if held is None:
            return None
        for i, (k, v) in enumerate(zip(keys, values)):
            held.add(i, k, v)
        return held.chunk()

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

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._chunks), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits}
