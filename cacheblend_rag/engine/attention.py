"""Attention as a blend needs it: every position causally, a subset of query positions over
every key, and by hand where the weights themselves are wanted.

Queries are ``[1, heads, rows, head_dim]`` and already rotated; keys and values are
``[1, kv_heads, n, head_dim]`` (GQA when ``kv_heads < heads``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cacheblend_rag.models.adapters import DecoderAdapter

# (query rows, keys the rows attend: [0, key_end), additive mask or None)
AttentionGroup = tuple[slice, int, "torch.Tensor | None"]


def causal_attention(a: DecoderAdapter, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of every position over every position (full prefill of a layer)."""
    total = q.shape[2]
    window = a.sliding_window(layer)
    scale = a.attention_scale(layer)
    gqa = a.num_heads != a.num_kv_heads
    if window is None or total <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    positions = torch.arange(total, device=q.device)
    offset = positions[None, :] - positions[:, None]  # key position minus query position
    allowed = (offset <= 0) & (offset > -window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def rows_per_group(device: torch.device) -> int:
    """The fewest query rows worth an attention call of their own. Each group is one call: on a CPU halving
    the work pays from 32 rows a group; on a GPU a call's launch costs more than a small group's arithmetic
    (an H200 runs 460 rows over 3,000 keys of a 1.5B layer in microseconds), so groups start at 1,024 rows
    there (an estimate from the operation counts, not yet timed on a GPU)."""
    return 32 if device.type == "cpu" else 1024


def attention_groups(
    query_positions: torch.Tensor, total: int, mask: str, window: int | None, dtype: torch.dtype
) -> list[AttentionGroup]:
    """Split sorted query positions into groups; each group attends only the keys up to its
    last position. A masked attention cannot skip the causal upper triangle, so grouping
    saves close to half of the attention work of the selected tokens."""
    m = query_positions.numel()
    device = query_positions.device
    groups = max(1, min(8, m // rows_per_group(device)))
    effective = torch.arange(total - m, total, device=device) if mask == "bottom_right" else query_positions
    bounds = sorted({0, m, *(round(m * g / groups) for g in range(1, groups))})
    plan = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        pos = effective[lo:hi]
        key_end = int(pos[-1]) + 1
        key_pos = torch.arange(key_end, device=device)
        allowed = key_pos[None, :] <= pos[:, None]
        if window is not None and total > window:
            allowed &= key_pos[None, :] > pos[:, None] - window
        # An additive float mask, built once: SDPA would convert a boolean mask on every call.
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        plan.append((slice(lo, hi), key_end, additive))
    return plan


class PartialAttention:
    """Attention of a set of query positions over every key, in position groups.

    The groups and their masks depend only on the positions, the mask kind and a layer's
    window, so they are built once and reused by every layer until :meth:`reset`
    (the set of positions changed)."""

    def __init__(self, mask: str = "exact") -> None:
        self.mask = mask
        self._plans: dict[int | None, list[AttentionGroup]] = {}

    def reset(self) -> None:
        self._plans.clear()

    def __call__(
        self, a: DecoderAdapter, layer: int, q_rot: torch.Tensor, key_layer: torch.Tensor,
        value_layer: torch.Tensor, positions: torch.Tensor,
    ) -> torch.Tensor:
        window = a.sliding_window(layer)
        if window not in self._plans:
            self._plans[window] = attention_groups(positions, key_layer.shape[2], self.mask, window, q_rot.dtype)
        return torch.cat([
            F.scaled_dot_product_attention(
                q_rot[:, :, rows], key_layer[:, :, :key_end], value_layer[:, :, :key_end],
                attn_mask=additive, scale=a.attention_scale(layer), enable_gqa=a.num_heads != a.num_kv_heads,
            )
            for rows, key_end, additive in self._plans[window]
        ], dim=2)


def attention_with_weights(
    a: DecoderAdapter, layer: int, q_rot: torch.Tensor, q_positions: torch.Tensor, key_layer: torch.Tensor,
    value_layer: torch.Tensor | None, hidden_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Causal attention of the queries ``q_rot`` (at ``q_positions``) over every key, by hand:
    the output ``[1, heads, rows, head_dim]`` (``None`` without ``value_layer``) and the
    weights ``[1, heads, rows, n]``, accumulated in float32. Keys at positions
    ``hidden_keys`` (a tensor of them) are masked out for every query."""
    _, heads, rows, dim = q_rot.shape
    kv_heads, n = key_layer.shape[1], key_layer.shape[2]
    group = heads // kv_heads
    # Query heads that share a K/V head are stacked as rows, so no K/V copy is made for GQA.
    stacked = q_rot.float().reshape(1, kv_heads, group * rows, dim) * a.attention_scale(layer)
    scores = (stacked @ key_layer.float().transpose(-1, -2)).view(1, heads, rows, n)
    window = a.sliding_window(layer)
    # Without a window every query sees all keys before the first query, so only the columns
    # from there on need a mask (for the question, its own few tokens, not all n).
    first = 0 if window is not None else int(q_positions.min())
    key_pos = torch.arange(first, n, device=q_rot.device)[None, :]
    blocked = key_pos > q_positions[:, None]
    if window is not None:
        blocked |= key_pos <= q_positions[:, None] - window
    scores[..., first:].masked_fill_(blocked, float("-inf"))
    if hidden_keys is not None and hidden_keys.numel():
        scores.index_fill_(-1, hidden_keys, float("-inf"))
    probs = scores.softmax(-1)
    if value_layer is None:
        return None, probs
    out = (probs.view(1, kv_heads, group * rows, n) @ value_layer.float()).view(1, heads, rows, dim)
    return out.to(q_rot.dtype), probs


def question_attention(
    a: DecoderAdapter, layer: int, q_rot: torch.Tensor, q_positions: torch.Tensor, key_layer: torch.Tensor
) -> torch.Tensor:
    """Attention mass ``[heads, n]`` that the queries ``q_rot`` (at ``q_positions``) pay each key,
    summed over the queries."""
    _, probs = attention_with_weights(a, layer, q_rot, q_positions, key_layer, None)
    return probs.sum(dim=2)[0]
