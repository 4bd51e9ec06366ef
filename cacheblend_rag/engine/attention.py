"""Attention as a blend needs it: every position causally, a subset of query positions over
every key, and by hand where the weights themselves are wanted.

Queries are ``[1, heads, rows, head_dim]`` and already rotated; keys and values are
``[1, kv_heads, n, head_dim]`` (GQA when ``kv_heads < heads``).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from cacheblend_rag.models.adapters import DecoderAdapter


class AttentionGroup(NamedTuple):
    """Query rows that attend keys ``[0, key_end)`` in one call: through ``mask`` (additive), causally
    (``causal``: the rows are positions ``0..key_end-1``, or, with ``lead`` zero rows put in front of them,
    positions ``lead..key_end-1``), or with nothing to mask (one row at the last key: every key is before it)."""

    rows: slice
    key_end: int
    mask: torch.Tensor | None
    causal: bool = False
    lead: int = 0


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
    """The fewest query rows worth an attention call of their own. Each group is one call, and a group
    attends keys up to its last row only, so more groups skip more of the causal upper triangle. On a CPU
    a call's fixed cost outweighs the triangle it saves below about 128 rows (SmolLM2, 10 x 200 tokens,
    blends at 0.15 on a 2-core Xeon with AMX: 32 rows a group 276/352 ms for CacheBlend/the default in
    bfloat16, 64 rows 250/316, 128 rows 245/300, one group 252/304; in float32 128 rows beat 64 by 2%);
    on a GPU a call's launch costs more than a small group's arithmetic (an H200 runs 460 rows over 3,000
    keys of a 1.5B layer in microseconds), so groups start at 1,024 rows there (an estimate from the
    operation counts)."""
    return 128 if device.type == "cpu" else 1024


def attention_groups(
    query_positions: torch.Tensor, host_positions: Sequence[int], total: int, mask: str, window: int | None,
    dtype: torch.dtype,
) -> list[AttentionGroup]:
    """Split sorted query positions (on the device, and the same on the host: their key ranges are read
    there, not from the device) into groups; each group attends only the keys up to its last position.
    A masked attention cannot skip the causal upper triangle, so grouping saves close to half of the
    attention work of the selected tokens. The masks are built on the device, once per set of positions."""
    m = len(host_positions)
    device = query_positions.device
    windowed = window is not None and total > window
    if not windowed and 0 < total - m <= m and host_positions[0] == total - m:
        # Every position from ``total - m`` on (what follows an exact prefix, a cached chat's new turn): one
        # causal call with the prefix's rows as zero queries in front, the same result as the masked groups
        # (and bottom-right alignment is this exact mask here), faster: a CPU's flash kernel skips the upper
        # triangle only when told the mask is causal. Computed and dropped, those rows cost a triangle of
        # ``total - m`` keys, hence at most as many as the rows kept (a long history with a short turn keeps
        # the groups). 3,061 tokens behind a 187-token exact prefix (SmolLM2, bfloat16, 2-core Xeon with AMX):
        # the whole computation 1.85 s -> 1.53 s, full prefill of all 3,248 tokens 1.45 s.
        return [AttentionGroup(slice(0, m), total, None, causal=True, lead=total - m)]
    groups = max(1, min(8, m // rows_per_group(device)))
    bottom_right = mask == "bottom_right"
    effective = torch.arange(total - m, total, device=device) if bottom_right else query_positions
    host = range(total - m, total) if bottom_right else host_positions
    bounds = sorted({0, m, *(round(m * g / groups) for g in range(1, groups))})
    plan = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        key_end = int(host[hi - 1]) + 1
        if not windowed and hi - lo == 1:
            plan.append(AttentionGroup(slice(lo, hi), key_end, None))
            continue
        if not windowed and hi - lo == key_end and int(host[lo]) == 0:
            plan.append(AttentionGroup(slice(lo, hi), key_end, None, causal=True))
            continue
        pos = effective[lo:hi]
        key_pos = torch.arange(key_end, device=device)
        allowed = key_pos[None, :] <= pos[:, None]
        if windowed:
            allowed &= key_pos[None, :] > pos[:, None] - window
        # An additive float mask, built once: SDPA would convert a boolean mask on every call.
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        plan.append(AttentionGroup(slice(lo, hi), key_end, additive))
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
        value_layer: torch.Tensor, positions: torch.Tensor, host_positions: Sequence[int],
    ) -> torch.Tensor:
        """``positions``: the query rows' positions (sorted), on the device and as ``host_positions``."""
        window = a.sliding_window(layer)
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = attention_groups(positions, host_positions, key_layer.shape[2], self.mask,
                                                          window, q_rot.dtype)
        scale, gqa = a.attention_scale(layer), a.num_heads != a.num_kv_heads
        outs = []
        for group in plan:
            q = q_rot if len(plan) == 1 else q_rot[:, :, group.rows]
            k, v = key_layer, value_layer
            if group.key_end < key_layer.shape[2]:
                k, v = k[:, :, : group.key_end], v[:, :, : group.key_end]
            if group.lead:
                q = torch.cat([q.new_zeros(q.shape[0], q.shape[1], group.lead, q.shape[3]), q], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, is_causal=group.causal, scale=scale,
                                                 enable_gqa=gqa)
            outs.append(out[:, :, group.lead:] if group.lead else out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def weights_mask(
    a: DecoderAdapter, layer: int, q_positions: torch.Tensor, n: int, dtype: torch.dtype,
    hidden_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """The additive mask :func:`attention_with_weights` takes for queries at ``q_positions`` over ``n``
    keys: causal, the layer's sliding window, and the keys ``hidden_keys`` (positions) masked for every
    query. ``[heads / kv_heads * rows, n]``, its rows stacked as the function stacks the query heads. It
    depends on the positions and the layer's window only, so a caller builds it once for many layers."""
    key_pos = torch.arange(n, device=q_positions.device)[None, :]
    blocked = key_pos > q_positions[:, None]
    window = a.sliding_window(layer)
    if window is not None:
        blocked |= key_pos <= q_positions[:, None] - window
    if hidden_keys is not None and hidden_keys.numel():
        blocked[:, hidden_keys] = True
    additive = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill_(blocked, float("-inf"))
    return additive.repeat(a.num_heads // a.num_kv_heads, 1)


def attention_with_weights(
    a: DecoderAdapter, layer: int, q_rot: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor | None,
    mask: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Attention of the queries ``q_rot`` over every key, by hand: the output ``[1, heads, rows, head_dim]``
    (``None`` without ``value_layer``) and the weights ``[1, heads, rows, n]`` in float32. ``mask`` is
    :func:`weights_mask`'s. The products run in the compute dtype (with float32 accumulation, as matrix
    multiplication does), the softmax in float32: no float32 copy of the layer's keys and values."""
    _, heads, rows, dim = q_rot.shape
    kv_heads, n = key_layer.shape[1], key_layer.shape[2]
    # Query heads that share a K/V head are stacked as rows, so no K/V copy is made for GQA.
    stacked = q_rot.reshape(kv_heads, heads // kv_heads * rows, dim)
    scores = torch.baddbmm(mask, stacked, key_layer[0].transpose(1, 2), alpha=a.attention_scale(layer))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if value_layer is None:
        return None, probs.view(1, heads, rows, n)
    out = torch.bmm(probs.to(value_layer.dtype), value_layer[0]).view(1, heads, rows, dim)
    return out, probs.view(1, heads, rows, n)


def question_attention(
    a: DecoderAdapter, layer: int, q_rot: torch.Tensor, q_positions: torch.Tensor, key_layer: torch.Tensor
) -> torch.Tensor:
    """Attention mass ``[heads, n]`` that the queries ``q_rot`` (at ``q_positions``) pay each key,
    summed over the queries."""
    mask = weights_mask(a, layer, q_positions, key_layer.shape[2], q_rot.dtype)
    _, probs = attention_with_weights(a, layer, q_rot, key_layer, None, mask)
    return probs.sum(dim=2)[0]
