"""Where a blend goes wrong, per question and method (``cacheblend-rag bench --diagnostics``).

Definitions (research/quality_notebook.md, "Diagnostics"):

* **KL by position**: KL(full prefill || method) at each teacher-forced answer position, in nats
  (the run's ``kl`` is its mean).
* **Token classes.** The blend's prompt positions are *exact prefix* (the cached lead, whose K/V
  is what full prefill computes), *blendable cached* (the passages), and *fresh* (no cached K/V:
  the question and the template after the passages). Among the blendable ones, *recomputed* are
  the blend's final selection (``stats.selected_positions``), *stale* the rest. Layers up to and
  including the check layer compute every token (blend_run.py), so there nothing is stale and
  every blendable token counts as recomputed; from the layer after it on, stale tokens keep the
  chunk's own K/V. Full reuse is stale from layer 0; a strategy choosing before layer 0 (a
  profile with check layer 0) too. A gradual strategy that narrows its choice over the layers
  recomputes some tokens in a few layers past the check layer that count as stale here.
* **K/V distance**, per layer and class: the mean over the class's tokens of
  ``||K_blend - K_full|| / ||K_full||`` (the norm over heads and head dimension, keys after RoPE
  on both sides), and the same for V.
* **Attention on stale entries**, per layer: the question's queries (the last fresh segment's)
  are run again through the layers over the blend's own merged cache, which reproduces the
  blend's computation for them exactly (``replay_logit_error`` checks it against the blend's
  first logits); their attention weights, averaged over heads and question tokens, are summed
  per class of key: stale, recomputed, exact prefix, fresh. The four shares sum to 1.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cacheblend_rag.bench.metrics import token_kl
from cacheblend_rag.bench.prompt import BenchPrompt
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.attention import attention_with_weights, weights_mask

KV = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer, [kv_heads, tokens, head_dim]


def _round(values: torch.Tensor | Sequence[float]) -> list[float]:
    # Six significant digits: the JSON stays small, and no diagnostic is read to more.
    items = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    return [float(f"{v:.6g}") for v in items]


def kl_by_position(reference_logits: torch.Tensor, logits: torch.Tensor) -> list[float]:
    return _round(token_kl(reference_logits, logits))


def first_stale_layer(mode: str, check_layer: int, chooses_before_layer_zero: bool) -> int:
    """The first layer in which unselected cached tokens keep their chunk K/V."""
    if mode == "full_reuse" or chooses_before_layer_zero:
        return 0
    return check_layer + 1


def _relative_distance(blend: torch.Tensor, full: torch.Tensor, positions: torch.Tensor) -> float | None:
    """Mean over ``positions`` of ``||blend - full|| / ||full||``; tensors ``[kv_heads, tokens, head_dim]``."""
    if positions.numel() == 0:
        return None
    b = blend[:, positions].float()
    f = full[:, positions].float().to(b.device)
    diff = (b - f).pow(2).sum(dim=(0, 2)).sqrt()
    norm = f.pow(2).sum(dim=(0, 2)).sqrt().clamp(min=1e-12)
    return float((diff / norm).mean())


@torch.inference_mode()
def blend_diagnostics(
    engine: Any, prompt: BenchPrompt, stats: dict[str, Any], blend_kv: KV, full_kv: KV, config: BlendConfig,
    check_layer: int, blend_first_logits: torch.Tensor | None = None,
) -> dict[str, Any]:
    """K/V distance to full prefill and the question's attention by class, per layer (module docstring).

    ``blend_kv``: the blend's merged prompt K/V; ``full_kv``: full prefill's; ``stats``: the blend's
    (``mode``, ``exact_tokens``, ``selected_positions``)."""
    a = engine.adapter
    n = prompt.num_tokens
    device = engine.device
    mode = stats.get("mode", "blend")
    strategy, _ = engine.plan(config)
    before_zero = check_layer == 0 and strategy.needs.profile is not None
    start_stale = first_stale_layer(mode, check_layer, before_zero)

    positions = torch.arange(n, device=device)
    cached_end = len(prompt.lead_ids) + sum(len(c) for c in prompt.chunk_ids)
    if mode == "full_prefill":  # the blend fell back: every token was computed
        exact_end, blendable = 0, torch.zeros(n, dtype=torch.bool, device=device)
    else:
        exact_end = int(stats.get("exact_tokens") or 0)
        blendable = (positions >= exact_end) & (positions < cached_end)
    selected = torch.zeros(n, dtype=torch.bool, device=device)
    chosen = stats.get("selected_positions") or []
    if chosen:
        selected[torch.tensor(chosen, dtype=torch.long, device=device)] = True
    exact = positions < exact_end
    fresh = ~blendable & ~exact

    def classes(layer: int) -> dict[str, torch.Tensor]:
        stale_here = layer >= start_stale
        return {
            "stale": blendable & ~selected if stale_here else torch.zeros_like(blendable),
            "recomputed": blendable & selected if stale_here else blendable,
            "exact_prefix": exact,
            "fresh": fresh,
        }

    distance: dict[str, dict[str, list[float | None]]] = {
        c: {"k": [], "v": []} for c in ("stale", "recomputed", "fresh")}
    for layer, ((kb, vb), (kf, vf)) in enumerate(zip(blend_kv, full_kv)):
        for name, mask in classes(layer).items():
            if name in distance:
                where = mask.nonzero().flatten()
                distance[name]["k"].append(_relative_distance(kb, kf, where))
                distance[name]["v"].append(_relative_distance(vb, vf, where))

    # The question's queries, replayed over the blend's merged cache.
    q_len = len(prompt.tail_ids)
    q_pos = torch.arange(n - q_len, n, device=device)
    ids = torch.tensor([prompt.tail_ids], dtype=torch.long, device=device)
    hidden = a.embed(ids)
    cos, sin = a.rope_cos_sin(hidden, q_pos.unsqueeze(0))
    shares: dict[str, list[float]] = {c: [] for c in ("stale", "recomputed", "exact_prefix", "fresh")}
    for layer in range(a.num_layers):
        q, _, _ = a.qkv(layer, a.input_norm(layer, hidden))
        q_rot = a.apply_rope(q, cos, sin)
        keys, values = blend_kv[layer]
        keys = keys.unsqueeze(0).to(device)
        out, probs = attention_with_weights(a, layer, q_rot, keys, values.unsqueeze(0).to(device),
                                            weights_mask(a, layer, q_pos, keys.shape[2], q_rot.dtype))
        weight = probs[0].float().mean(dim=(0, 1))  # [n]: averaged over heads and question tokens
        for name, mask in classes(layer).items():
            shares[name].append(float(weight[mask].sum()))
        assert out is not None
        hidden = a.mlp_block(layer, hidden + a.attention_output(layer, out))
    result: dict[str, Any] = {
        "first_stale_layer": start_stale,
        "tokens": {"stale": int((blendable & ~selected).sum()), "recomputed": int((blendable & selected).sum()),
                   "exact_prefix": int(exact.sum()), "fresh": int(fresh.sum()), "question": q_len},
        "kv_distance": {c: {kv: [None if x is None else float(f"{x:.6g}") for x in xs] for kv, xs in d.items()}
                        for c, d in distance.items()},
        "attention_share": {c: _round(v) for c, v in shares.items()},
    }
    if blend_first_logits is not None:
        replay = a.final_logits(hidden[:, -1:])[0, -1].float().cpu()
        result["replay_logit_error"] = float(f"{float((replay - blend_first_logits.float().cpu()).abs().max()):.6g}")
    return result
