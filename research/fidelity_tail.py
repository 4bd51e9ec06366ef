"""The last layers recomputed for every token, for the research loop (issue 29): a blend whose budget grows
with depth instead of shrinking.

The oracles of research/quality_notebook.md say the 1.5B model's loss sits in the late layers' stale keys (exact
keys in layers 14-27 alone recover 74%, exact K and V there 92%), and that no choice of 15% of the tokens fixes them,
because nearly every token's late-layer K/V depends on the other passages. CacheBlend spends its budget the
other way round: every token in the first layers, a share after. ``tail_layers=T`` adds the opposite end:
in the last ``T`` layers every cached token is computed again, so its late K/V see the whole prompt. A stale
token has no hidden state of its own at that depth (the blend never carried it); it starts from the one its
chunk computed alone, which a store could keep beside the chunk's K/V (one hidden vector a token: 3x one
layer's K+V on Qwen2.5-1.5B, so +11% of a chunk's entry). ``tail_drift``: that stored hidden state moved
by its chunk's mean drift at the tail's first layer, measured on the tokens the blend carried there
(``selected``: every recomputed token; ``probes``: the probes only, when there are any).

Its cost: the tail's ``T`` layers for every token, ``T / num_layers`` of full prefill, on top of the blend.
Research code: it patches ``BlendRun`` while active and is not part of the package.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Sequence

import torch

from cacheblend_rag.engine.attention import causal_attention
from cacheblend_rag.engine.blend_run import BlendRun
from cacheblend_rag.models.adapters import DecoderAdapter
from fidelity_oracle import attribute_replaced  # noqa: E402  (research/ on sys.path)

TAIL_OPTIONS = ("tail_layers", "tail_drift")
DRIFTS = ("none", "selected", "probes")


@torch.no_grad()
def chunk_hidden_states(a: DecoderAdapter, chunks: Sequence[Sequence[int]], prefix: Sequence[int],
                        layer: int) -> torch.Tensor:
    """The residual stream entering ``layer`` for every token of each chunk computed on its own behind
    ``prefix`` (what the chunk's KV was computed behind), the chunks back to back: ``[tokens, hidden]``."""
    out = []
    for chunk in chunks:
        ids = torch.tensor([list(prefix) + list(chunk)], dtype=torch.long)
        hidden = a.embed(ids)
        cos, sin = a.rope_cos_sin(hidden, torch.arange(ids.shape[1]).unsqueeze(0))
        for index in range(layer):
            q, k, v = a.qkv(index, a.input_norm(index, hidden))
            attn = causal_attention(a, index, a.apply_rope(q, cos, sin), a.apply_rope(k, cos, sin), v)
            hidden = a.mlp_block(index, hidden + a.attention_output(index, attn))
        out.append(hidden[0, len(prefix):])
    return torch.cat(out)


def widen(run: BlendRun, stored: torch.Tensor, drift: str) -> None:
    """Carry every blendable cached token from here on: the stale ones from ``stored`` (one row per
    blendable cached token), moved by their chunk's mean drift when ``drift`` is not ``none``."""
    layout = run.layout
    cached_pos = layout.cached_pos
    carried = torch.isin(cached_pos, run.active)
    stale = torch.nonzero(~carried).flatten()
    if not stale.numel():
        return
    active = torch.sort(torch.cat([run.active, cached_pos[stale]])).values
    hidden = run.hidden.new_zeros(1, active.numel(), run.hidden.shape[-1])
    hidden[:, torch.searchsorted(active, run.active)] = run.hidden
    fill = stored[stale].to(hidden.dtype)
    if drift != "none":
        estimators = torch.nonzero(carried).flatten()
        if drift == "probes" and run.probes.numel():
            estimators = run.probes[torch.isin(run.probes, estimators)]
        rows = torch.searchsorted(run.active, cached_pos[estimators])
        change = run.hidden[0, rows].float() - stored[estimators].float()
        chunk_of = torch.zeros(layout.n_cached, dtype=torch.long)
        for index, (start, end) in enumerate(layout.chunk_spans):
            chunk_of[start:end] = index
        n_chunks = len(layout.chunk_spans)
        totals = change.new_zeros(n_chunks, change.shape[-1]).index_add_(0, chunk_of[estimators], change)
        counts = torch.bincount(chunk_of[estimators], minlength=n_chunks).clamp(min=1).unsqueeze(-1)
        fill = fill + (totals / counts)[chunk_of[stale]].to(fill.dtype)
    hidden[:, torch.searchsorted(active, cached_pos[stale])] = fill
    run.hidden, run.active, run.active_host = hidden, active, active.tolist()
    run.attention.reset()


def tail_blend(stored: torch.Tensor, first_layer: int, drift: str = "none") -> AbstractContextManager[None]:
    """Every blend run inside computes every token from ``first_layer`` on (``stored``: the stale tokens'
    hidden states entering that layer, one row per blendable cached token)."""
    if drift not in DRIFTS:
        raise ValueError(f"tail_drift={drift!r}: choose one of {', '.join(DRIFTS)}")
    original = BlendRun._layer

    def patched(self: BlendRun, layer: int) -> str:
        if layer == first_layer and self.layout.n_cached:
            widen(self, stored, drift)
        return original(self, layer)

    return attribute_replaced(BlendRun, "_layer", patched)
