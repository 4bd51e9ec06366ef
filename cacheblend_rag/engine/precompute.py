"""Chunk precompute: each chunk's K (before RoPE) and V, computed on its own or behind a prefix.

This is CacheBlend's offline step. Keys are kept un-rotated, so a chunk can be placed at any
position later by one rotation. Chunks of similar length share a right-padded batch: with a
causal mask, padding after a chunk can never be attended by it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cacheblend_rag.engine.attention import causal_attention
from cacheblend_rag.kv.segments import ChunkKV
from cacheblend_rag.errors import BlendInputError
from cacheblend_rag.models.adapters import DecoderAdapter


def forward_kv(a: DecoderAdapter, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Causal forward of every token of ``ids`` (``[batch, tokens]``); per-layer K (before RoPE) and V."""
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
    hidden = a.embed(ids)
    cos, sin = a.rope_cos_sin(hidden, positions)
    keys, values = [], []
    last = a.num_layers - 1
    for layer in range(a.num_layers):
        q, k, v = a.qkv(layer, a.input_norm(layer, hidden))
        keys.append(k)
        values.append(v)
        if layer == last:
            break  # the last layer's K/V do not depend on its own output
        attn = causal_attention(a, layer, a.apply_rope(q, cos, sin), a.apply_rope(k, cos, sin), v)
        hidden = a.mlp_block(layer, hidden + a.attention_output(layer, attn))
    return keys, values


def precompute_chunks(
    a: DecoderAdapter, chunks: Sequence[Sequence[int]], *, prefix_ids: Sequence[int], batch_size: int,
    device: torch.device, fingerprint: str,
) -> list[ChunkKV]:
    """The KV of every chunk, in the order given, computed behind ``prefix_ids`` (not stored)."""
    prefix = [int(t) for t in prefix_ids]
    chunk_lists = [[int(t) for t in c] for c in chunks]
    for i, c in enumerate(chunk_lists):
        if not c:
            raise BlendInputError(f"chunk {i} is empty; a cached chunk needs at least one token")
        if len(prefix) + len(c) > a.max_positions:
            raise BlendInputError(
                f"chunk {i} has {len(c)} tokens (+{len(prefix)} prefix), more than the model's "
                f"context of {a.max_positions}; split it into smaller chunks"
            )
    results: list[ChunkKV | None] = [None] * len(chunk_lists)
    order = sorted(range(len(chunk_lists)), key=lambda i: len(chunk_lists[i]))
    pad_id = 0
    for start in range(0, len(order), max(1, batch_size)):
        batch = order[start : start + batch_size]
        longest = max(len(chunk_lists[i]) for i in batch)
        rows = [prefix + chunk_lists[i] + [pad_id] * (longest - len(chunk_lists[i])) for i in batch]
        keys, values = forward_kv(a, torch.tensor(rows, dtype=torch.long, device=device))
        for row, i in enumerate(batch):
            span = slice(len(prefix), len(prefix) + len(chunk_lists[i]))
            results[i] = ChunkKV(
                token_ids=tuple(chunk_lists[i]),
                keys=[k[row, :, span].clone() for k in keys],
                values=[v[row, :, span].clone() for v in values],
                prefix_ids=tuple(prefix),
                model_fingerprint=fingerprint,
            )
    return [r for r in results if r is not None]
