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
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers import AttentionInterface

from cacheblend_rag.engine import attention as engine_attention
from fidelity_oracle import attribute_replaced  # noqa: E402  (research/ on sys.path)

_STATE: dict[str, Any] = {}
_NAME = "ape_research"


@dataclass(frozen=True)
class ApeSetting:
    """APE's temperature ``T`` over the context and scale ``S`` on its log-sum-exp, and ``mass`` (ours,
    not APE's): a fixed factor on the context's share, ``lse_C + log(mass)``, whatever the size of its
    logits (APE's ``S * lse_C`` moves the share by ``exp((S - 1) lse_C)``, large where the logits are).
    All three at 1: exact attention."""

    temperature: float = 1.0
    lse_scale: float = 1.0
    mass: float = 1.0


def ape_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor,
                  context_keys: torch.Tensor, scale: float, setting: ApeSetting) -> torch.Tensor:
    """``q`` ``[1, heads, rows, d]`` at ``query_positions``; ``k``/``v`` ``[1, kv_heads, n, d]``;
    ``context_keys`` a bool ``[n]``. Causal. Returns ``[1, heads, rows, d]``."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    n = k.shape[2]
    allowed = torch.arange(n, device=q.device)[None, :] <= query_positions[:, None]
    in_context = allowed & context_keys[None, :]
    in_other = allowed & ~context_keys[None, :]
    neg = torch.finfo(logits.dtype).min
    lc = torch.where(in_context, logits / setting.temperature, neg)
    lo = torch.where(in_other, logits, neg)
    lse_c = torch.logsumexp(lc, dim=-1, keepdim=True)
    lse_o = torch.logsumexp(lo, dim=-1, keepdim=True)
    has_c = in_context.any(dim=-1)[None, None, :, None]
    out_c = torch.matmul(torch.softmax(lc, dim=-1) * in_context, v.float())
    out_o = torch.matmul(torch.softmax(lo, dim=-1) * in_other, v.float())
    context_weight = torch.where(has_c, setting.lse_scale * lse_c + math.log(setting.mass), neg)
    mix = torch.softmax(torch.cat([context_weight, lse_o], dim=-1), dim=-1)
    return (mix[..., :1] * out_c + mix[..., 1:] * out_o).to(q.dtype)


def _partial(self, a, layer, q_rot, key_layer, value_layer, positions, host_positions):  # PartialAttention.__call__
    assert self.mask == "exact" and a.sliding_window(layer) is None, "APE research: exact mask, no window"
    stale = _STATE["context"].clone()
    stale[positions] = False  # the rows computed now (the question, the recomputed tokens) are not stale
    return ape_attention(q_rot, key_layer, value_layer, positions, stale, a.attention_scale(layer), _STATE["setting"])


def _hf_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    # One sequence, causal, no window: the research loop's teacher forcing; anything else is refused.
    assert query.shape[0] == 1 and kwargs.get("sliding_window") is None, "APE research: one sequence, no window"
    n, rows = key.shape[2], query.shape[2]
    positions = torch.arange(n - rows, n, device=query.device)
    stale = torch.zeros(n, dtype=torch.bool, device=query.device)
    known = _STATE["stale"]
    stale[: known.numel()] = known
    out = ape_attention(query, key, value, positions, stale, scaling, _STATE["setting"])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(_NAME, _hf_attention)


@contextmanager
def _swapped(owner: Any, attribute: str, value: Any, **state: Any) -> Iterator[None]:
    """``owner.attribute`` set to ``value``, and ``state`` kept for the hooks, until the block ends."""
    _STATE.update(state)
    with attribute_replaced(owner, attribute, value):
        yield


def ape_blend(context_positions: torch.Tensor, prompt_length: int, setting: ApeSetting):
    """Inside, the engine's blends use APE's attention over the stale entries among ``context_positions``
    (the cached chunk tokens of a ``prompt_length``-token prompt)."""
    context = torch.zeros(prompt_length, dtype=torch.bool)
    context[context_positions] = True
    return _swapped(engine_attention.PartialAttention, "__call__", _partial, context=context, setting=setting)


def ape_teacher_forcing(model: Any, stale: torch.Tensor, setting: ApeSetting):
    """Inside, ``model``'s attention is APE's over the prompt positions ``stale`` (bool ``[prompt_length]``)."""
    return _swapped(model.config, "_attn_implementation", _NAME, stale=stale, setting=setting)
