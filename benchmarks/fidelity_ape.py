"""APE's attention (Yang et al., arXiv 2502.05431) over a blend's stale entries, for the research loop.

APE aligns parallel-encoded context with sequential encoding at inference time: a shared prefix (here the
prompt's lead, which every blend takes as an exact prefix), a lower attention temperature ``T`` over the
context keys, and a scale ``S`` on the context part's log-sum-exp. A query row attends the context keys
``C`` and the others ``O`` separately, ``softmax(qk/(T sqrt d))`` over ``C`` and ``softmax(qk/sqrt d)``
over ``O``, and mixes the two outputs with the weights ``softmax([S * lse_C, lse_O])``; ``T = S = 1`` is
exact attention. Here the context is what a blend did not recompute (the *stale* cached chunk tokens): a
recomputed token's K/V already saw the other passages. It applies to every row a blend computes after
its choice (the question and the recomputed tokens) and to the teacher-forced answer tokens, through a
transformers attention function registered for the duration, so that every scored position sees it.
Research code: it patches the engine's partial attention while active and is not part of the package.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import AttentionInterface

from cacheblend_rag.engine import attention as engine_attention

_STATE: dict[str, object] = {}
_NAME = "ape_research"


def ape_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor,
                  context_keys: torch.Tensor, scale: float, temperature: float, lse_scale: float,
                  mass: float = 1.0) -> torch.Tensor:
    """``q`` ``[1, heads, rows, d]`` at ``query_positions``; ``k``/``v`` ``[1, kv_heads, n, d]``;
    ``context_keys`` a bool ``[n]``. Causal. Returns ``[1, heads, rows, d]``. ``mass`` (ours, not APE's)
    multiplies the context's share before normalising, ``lse_C + log(mass)``: a change of the context's
    attention by a fixed factor, whatever the size of its logits (APE's ``S * lse_C`` moves it by
    ``exp((S - 1) lse_C)``, which is large where the logits are)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    n = k.shape[2]
    allowed = torch.arange(n, device=q.device)[None, :] <= query_positions[:, None]
    in_context = allowed & context_keys[None, :]
    in_other = allowed & ~context_keys[None, :]
    neg = torch.finfo(logits.dtype).min
    lc = torch.where(in_context, logits / temperature, neg)
    lo = torch.where(in_other, logits, neg)
    lse_c = torch.logsumexp(lc, dim=-1, keepdim=True)
    lse_o = torch.logsumexp(lo, dim=-1, keepdim=True)
    has_c = in_context.any(dim=-1)[None, None, :, None]
    out_c = torch.matmul(torch.softmax(lc, dim=-1) * in_context, v.float())
    out_o = torch.matmul(torch.softmax(lo, dim=-1) * in_other, v.float())
    mix = torch.softmax(torch.cat([torch.where(has_c, lse_scale * lse_c + math.log(mass), neg), lse_o], dim=-1), dim=-1)
    return (mix[..., :1] * out_c + mix[..., 1:] * out_o).to(q.dtype)


def _partial(self, a, layer, q_rot, key_layer, value_layer, positions):  # PartialAttention.__call__
    context = _STATE["context"]
    assert self.mask == "exact" and a.sliding_window(layer) is None, "APE research: exact mask, no window"
    stale = context.clone()
    stale[positions] = False  # the rows computed now (the question, the recomputed tokens) are not stale
    return ape_attention(q_rot, key_layer, value_layer, positions, stale, a.attention_scale(layer),
                         _STATE["temperature"], _STATE["lse_scale"], _STATE["mass"])


def _hf_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    # One sequence, causal, no window: the research loop's teacher forcing; anything else is refused.
    assert query.shape[0] == 1 and kwargs.get("sliding_window") is None, "APE research: one sequence, no window"
    n, rows = key.shape[2], query.shape[2]
    positions = torch.arange(n - rows, n, device=query.device)
    stale = torch.zeros(n, dtype=torch.bool, device=query.device)
    known = _STATE["stale"]
    stale[: known.numel()] = known
    out = ape_attention(query, key, value, positions, stale, scaling, _STATE["temperature"], _STATE["lse_scale"], _STATE["mass"])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(_NAME, _hf_attention)


@contextmanager
def ape_blend(context_positions: torch.Tensor, prompt_length: int, temperature: float, lse_scale: float,
              mass: float = 1.0) -> Iterator[None]:
    """Inside, the engine's blends use APE's attention over the stale entries among ``context_positions``
    (the cached chunk tokens of a ``prompt_length``-token prompt)."""
    context = torch.zeros(prompt_length, dtype=torch.bool)
    context[context_positions] = True
    _STATE.update(context=context, temperature=float(temperature), lse_scale=float(lse_scale), mass=float(mass))
    original = engine_attention.PartialAttention.__call__
    engine_attention.PartialAttention.__call__ = _partial
    try:
        yield
    finally:
        engine_attention.PartialAttention.__call__ = original


@contextmanager
def ape_teacher_forcing(model, stale: torch.Tensor, temperature: float, lse_scale: float,
                        mass: float = 1.0) -> Iterator[None]:
    """Inside, ``model``'s attention is APE's over the prompt positions ``stale`` (bool ``[prompt_length]``)."""
    _STATE.update(stale=stale, temperature=float(temperature), lse_scale=float(lse_scale), mass=float(mass))
    before = model.config._attn_implementation
    model.config._attn_implementation = _NAME
    try:
        yield
    finally:
        model.config._attn_implementation = before
