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

from cacheblend_rag.engine.attention import PartialAttention, attention_with_weights
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
    fresh_pos, cached_pos, question_len = layout.fresh_pos, layout.cached_pos, layout.question_len
    n_fresh = fresh_pos.numel()
    if question_tokens is not None and question_tokens < question_len:
        question_len = question_tokens
    lead = fresh_pos[: n_fresh - layout.question_len]
    if cached_pos.numel():
        lead = lead[lead < cached_pos[0]]
    active = torch.cat([lead, fresh_pos[n_fresh - question_len:]])
    hidden_fresh = fresh_pos[~torch.isin(fresh_pos, active)]  # fresh positions the pass leaves out
    hidden = a.embed(layout.ids[active].unsqueeze(0))
    q_cos, q_sin = a.rope_halves(merged.cos[:, active], merged.sin[:, active])
    question_rows = slice(active.numel() - question_len, None)
    lead_rows = slice(0, active.numel() - question_len)
    lead_attention = PartialAttention("exact")
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    scores = torch.zeros(cached_pos.numel(), dtype=torch.float32, device=cached_pos.device)
    for layer in range(layers):
        q, k, v = a.qkv(layer, a.input_norm(layer, hidden))
        key_layer, value_layer = merged.read(layer)
        key_layer.index_copy_(2, active, a.apply_rope(k, q_cos, q_sin))
        value_layer.index_copy_(2, active, v)
        keys.append(key_layer)
        values.append(value_layer)
        q_rot = a.apply_rope(q, q_cos, q_sin)
        # The question's rows are computed by hand, so their attention weights serve both the
        # profile and the layer's output; the other fresh rows (the lead) go through SDPA.
        q_out, probs = attention_with_weights(a, layer, q_rot[:, :, question_rows], active[question_rows],
                                              key_layer, value_layer, hidden_keys=hidden_fresh)
        assert q_out is not None
        mass = probs.sum(dim=2)[0][:, cached_pos]  # [heads, n_cached]
        scores += (mass / mass.sum(dim=1, keepdim=True).clamp(min=1e-12)).sum(dim=0)
        if layer == layers - 1:
            break  # the last profiled layer's output is not needed
        if lead_rows.stop > 0:
            lead_out = lead_attention(a, layer, q_rot[:, :, lead_rows], key_layer, value_layer, active[lead_rows])
            q_out = torch.cat([lead_out, q_out], dim=2)
        hidden = a.mlp_block(layer, hidden + a.attention_output(layer, q_out))
    return Profile(keys=keys, values=values, question_attention=scores)
