"""Where the blend reads cached K/V from, one layer at a time, and what it needs of a store for that.

The engine asks for layer ``l`` of *all* cached tokens, in prompt order, exactly
when it needs it. A source backed by slow storage uses that order to fetch
layer ``l + 1`` while layer ``l`` computes (see ``cacheblend_rag.store.loader``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, Sequence

import torch

from cacheblend_rag.kv.segments import CachedSegment, ChunkKV, FreshSegment, PrefixSegment, Segment, StoredSegment


class CachedKVSource(ABC):
    """Per-layer K (before RoPE) and V of the cached tokens, ``[kv_heads, n_cached, head_dim]``."""

    wait_seconds: float = 0.0  # time the engine spent blocked on this source
    recompute_seconds: float = 0.0  # time spent computing chunks whose stored copy failed mid-read
    # this request's failed read of the store (manifests or layers), redacted; None: none failed
    store_error: str | None = None

    @property
    def load_failures(self) -> int:
        """Chunks found in a store whose KV could not be read whole (the store failed, a layer was
        gone or damaged) and were computed afresh instead: not hits, whatever the manifest said."""
        return 0

    @property
    def computed_tokens(self) -> int:
        """Tokens of the chunks whose KV was computed for this request (misses and load failures)."""
        return 0

    @property
    def memory_hits(self) -> int:
        """Stored chunks whose KV came from the chunk cache's host-memory tier (resident) instead of a store
        read: a share of the hits, which the response's per-request ``chunk_tiers`` tells apart."""
        return 0

    @abstractmethod
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def lossless(self) -> list[bool]:
        """Per chunk, in order: whether its K/V are exactly what the engine computed (not rounded or
        quantized by storage). Only such chunks can form an exact prefix."""
        raise NotImplementedError

    def layer_parts(self, index: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer ``index`` split per chunk. Sources that hold chunks apart override this to skip a copy."""
        k, v = self.layer(index)
        return list(zip(torch.split(k, lengths, dim=1), torch.split(v, lengths, dim=1)))

    def close(self) -> None:  # noqa: B027 (optional: a source without background work has nothing to release)
        """Release background work; called once the blend is done, also on error."""


class InMemoryKVSource(CachedKVSource):
    """Chunks at hand: passed in (``computed=False``) or just computed for this request."""

    def __init__(self, chunks: Sequence[ChunkKV], device: torch.device, dtype: torch.dtype, *,
                 computed: bool = False, store_error: str | None = None) -> None:
        self.chunks = list(chunks)
        self.store_error = store_error  # computed because the store could not be read
        self.device = device
        self.dtype = dtype
        self.computed = computed

    @property
    def computed_tokens(self) -> int:
        return sum(len(c) for c in self.chunks) if self.computed else 0

    def lossless(self) -> list[bool]:
        return [c.keys[0].dtype == self.dtype or c.keys[0].dtype == torch.float32 for c in self.chunks]

    def layer_parts(self, index: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self._here(c.keys[index]), self._here(c.values[index])) for c in self.chunks]

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        # Checked in Python: a no-op ``.to`` still costs a dispatch, and a GPU blend pays one per chunk and layer.
        if t.dtype == self.dtype and (t.device == self.device or (
                t.device.type == self.device.type == "cuda" and self.device.index is None
                and t.device.index == torch.cuda.current_device())):
            return t
        return t.to(device=self.device, dtype=self.dtype, non_blocking=True)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [c.keys[index] for c in self.chunks]
        values = [c.values[index] for c in self.chunks]
        k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)
        v = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        return (k.to(device=self.device, dtype=self.dtype, non_blocking=True),
                v.to(device=self.device, dtype=self.dtype, non_blocking=True))


class InterleavedKVSource(CachedKVSource):
    """Cached tokens of several sources, interleaved back into prompt order."""

    def __init__(self, parts: list[tuple[CachedKVSource, list[int]]], order: list[tuple[int, int]]) -> None:
        # parts: (source, lengths of its chunks in its own order); order: (part index, chunk index) per chunk
        self.parts = parts
        self.order = order

    @property
    def wait_seconds(self) -> float:  # type: ignore[override]
        return sum(p.wait_seconds for p, _ in self.parts)

    @property
    def recompute_seconds(self) -> float:  # type: ignore[override]
        return sum(p.recompute_seconds for p, _ in self.parts)

    def layer_parts(self, index: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        split = [source.layer_parts(index, part_lengths) for source, part_lengths in self.parts]
        return [split[p][c] for p, c in self.order]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.layer_parts(index, [])
        return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)

    @property
    def load_failures(self) -> int:
        return sum(p.load_failures for p, _ in self.parts)

    @property
    def computed_tokens(self) -> int:
        return sum(p.computed_tokens for p, _ in self.parts)

    @property
    def memory_hits(self) -> int:
        return sum(p.memory_hits for p, _ in self.parts)

    @property
    def store_error(self) -> str | None:  # type: ignore[override]
        return next((p.store_error for p, _ in self.parts if p.store_error), None)

    def lossless(self) -> list[bool]:
        flags = [source.lossless() for source, _ in self.parts]
        return [flags[p][c] for p, c in self.order]

    def close(self) -> None:
        for source, _ in self.parts:
            source.close()


class KVSourceProvider(Protocol):
    """What ``blend(store=...)`` needs from a store: a layer-wise source for stored chunks."""

    def open_source(
        self, engine: Any, segments: Sequence[StoredSegment], *, first_layer: int = 0
    ) -> tuple[CachedKVSource, int, int]:
        """Returns the source (stored chunks concatenated in order), hits and misses.
        ``first_layer`` is the first layer the blend will read, so a loader can fetch it first."""
        ...


def open_cached_source(
    engine: Any, segs: Sequence[Segment], store: KVSourceProvider | None, first_layer: int
) -> tuple[CachedKVSource, int, int]:
    """One source over every cached chunk of ``segs`` in prompt order (in-memory chunks and stored
    ones read through ``store``; a prefix segment is not a chunk), with the numbers of cache hits
    and misses."""
    cached = [s for s in segs if isinstance(s, CachedSegment)]
    stored = [s for s in segs if isinstance(s, StoredSegment)]
    memory = InMemoryKVSource([s.chunk for s in cached], engine.device, engine.dtype) if cached else None
    if not stored:  # no chunk at all (a prompt cached only as a prefix segment): an empty source
        return memory or InMemoryKVSource([], engine.device, engine.dtype), len(cached), 0
    assert store is not None
    from_store, hits, misses = store.open_source(engine, stored, first_layer=first_layer)
    if memory is None:
        return from_store, hits, misses
    parts = [(memory, [len(s.token_ids) for s in cached]), (from_store, [len(s.token_ids) for s in stored])]
    order, counters = [], [0, 0]
    for s in segs:
        if isinstance(s, (FreshSegment, PrefixSegment)):  # not chunks of either source
            continue
        part = 0 if isinstance(s, CachedSegment) else 1
        order.append((part, counters[part]))
        counters[part] += 1
    return InterleavedKVSource(parts, order), hits + len(cached), misses
