"""Where the blend reads cached K/V from, one layer at a time.

The engine asks for layer ``l`` of *all* cached tokens, in prompt order, exactly
when it needs it. A source backed by slow storage uses that order to fetch
layer ``l + 1`` while layer ``l`` computes (see ``cacheblend_rag.store.loader``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from cacheblend_rag.engine.segments import ChunkKV


class CachedKVSource(ABC):
    """Per-layer K (before RoPE) and V of the cached tokens, ``[kv_heads, n_cached, head_dim]``."""

    wait_seconds: float = 0.0  # time the engine spent blocked on this source

    @abstractmethod
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def layer_parts(self, index: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer ``index`` split per chunk. Sources that hold chunks apart override this to skip a copy."""
        k, v = self.layer(index)
        return list(zip(torch.split(k, lengths, dim=1), torch.split(v, lengths, dim=1)))

    def close(self) -> None:
        """Release background work; called once the blend is done, also on error."""


class InMemoryKVSource(CachedKVSource):
    def __init__(self, chunks: Sequence[ChunkKV], device: torch.device, dtype: torch.dtype) -> None:
        self.chunks = list(chunks)
        self.device = device
        self.dtype = dtype

    def layer_parts(self, index: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (c.keys[index].to(device=self.device, dtype=self.dtype, non_blocking=True),
             c.values[index].to(device=self.device, dtype=self.dtype, non_blocking=True))
            for c in self.chunks
        ]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [c.keys[index] for c in self.chunks]
        values = [c.values[index] for c in self.chunks]
        k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)
        v = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        return (k.to(device=self.device, dtype=self.dtype, non_blocking=True),
                v.to(device=self.device, dtype=self.dtype, non_blocking=True))
