"""The profile pass: which cached tokens the question reads, measured in full KV reuse.

A strategy that asks for a profile (``query_profiled``) gets it before the blend: full KV
reuse (only the fresh tokens compute) through the first layers, recording how much
attention the question pays every cached token. The pass also leaves each of those layers'
merged, rotated K/V behind, which the blend then patches in place instead of reading the
store again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cacheblend_rag.engine.attention import PartialAttention, attention_with_weights, weights_mask
from cacheblend_rag.engine.layout import MergedLayers, PromptLayout
from cacheblend_rag.models.adapters import DecoderAdapter


@dataclass
class Profile:
    """The merged per-layer K/V of full reuse over the profiled layers, and the attention the
    question paid each blendable cached token, summed over layers and heads."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    question_attention: torch.Tensor  # [n_cached]

    def covers(self, layer: int) -> bool:
        return layer < len(self.keys)


def profile_question(
    a: DecoderAdapter, layout: PromptLayout, merged: MergedLayers, layers: int, question_tokens: int | None
) -> Profile:
    """Full KV reuse over the first ``layers`` layers, recording the attention the question pays
    each cached token. Per layer and head the mass is normalised over the cached tokens, so heads
    that mostly attend the fresh lead or the question itself still count.

    The pass is an estimate that only ranks tokens; the blend then computes every fresh token
    exactly. So it runs only the fresh tokens it needs: the lead before the first cached token
    (a template's opening, whose K/V the blend takes from this pass when it covers every layer)
    and the question's last ``question_tokens`` tokens (``None``: all of the last fresh segment).
    The rest of the question (on a RAG prompt, mostly the fixed instruction before it) and the
    fresh glue between cached tokens (separators; in a chat, each turn's template around its
    passages) are left out of the pass altogether, and the kept tokens do not see them."""
    fresh, question_len = layout.fresh_list, layout.question_len
    if question_tokens is not None and question_tokens < question_len:
        question_len = question_tokens
    first_cached = layout.cached_list[0] if layout.cached_list else layout.n
    # Both are runs of positions known on the host: the lead ends where the first cached token starts.
    lead = [p for p in fresh[: len(fresh) - layout.question_len] if p < first_cached]
    active_list = lead + fresh[len(fresh) - question_len:]
    kept = set(active_list)
    device = layout.positions.device
    active = torch.tensor(active_list, dtype=torch.long, device=device)
    hidden_fresh = torch.tensor([p for p in fresh if p not in kept], dtype=torch.long, device=device)
    hidden = a.embed(layout.ids[active].unsqueeze(0))
    rope = a.rope_tables(merged.cos[:, active], merged.sin[:, active])
    rows = len(active_list)
    question_rows = slice(rows - question_len, None)
    lead_attention = PartialAttention("exact")
    masks: dict[int | None, torch.Tensor] = {}  # per sliding window: the question rows' mask
    mass = torch.zeros(layers, a.num_heads, layout.n, dtype=torch.float32, device=device)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(layers):
        qkv = a.qkv_heads(layer, a.input_norm(layer, hidden))
        rotated = a.apply_rope(qkv[:, : a.qk_heads], *rope)
        q_rot, v = rotated[:, : a.num_heads], qkv[:, a.qk_heads :]
        key_layer, value_layer = merged.read(layer)
        key_layer.index_copy_(2, active, rotated[:, a.num_heads :])
        value_layer.index_copy_(2, active, v)
        keys.append(key_layer)
        values.append(value_layer)
        window = a.sliding_window(layer)
        if window not in masks:
            masks[window] = weights_mask(a, layer, active[question_rows], layout.n, q_rot.dtype, hidden_fresh)
        # The question's rows are computed by hand, so their attention weights serve both the
        # profile and the layer's output; the other fresh rows (the lead) go through SDPA.
        q_out, probs = attention_with_weights(a, layer, q_rot[:, :, question_rows], key_layer, value_layer,
                                              masks[window])
        assert q_out is not None
        torch.sum(probs[0], dim=1, out=mass[layer])
        if layer == layers - 1:
            break  # the last profiled layer's output is not needed
        if lead:
            lead_out = lead_attention(a, layer, q_rot[:, :, : len(lead)], key_layer, value_layer,
                                      active[: len(lead)], lead)
            q_out = torch.cat([lead_out, q_out], dim=2)
        hidden = a.mlp_block(layer, hidden + a.attention_output(layer, q_out))
    # Per layer and head the mass is normalised over the cached tokens, then summed: one pass for all layers.
    cached_mass = mass[:, :, layout.cached_pos]
    scores = (cached_mass / cached_mass.sum(dim=2, keepdim=True).clamp(min=1e-12)).sum(dim=(0, 1))
    return Profile(keys=keys, values=values, question_attention=scores)
