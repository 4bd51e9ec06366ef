"""The work bound of a blend: the TTFT speedup over full prefill it could reach if time followed
the tokens each layer computes, worked out from a model's shapes (research/quality_notebook.md, "Not run
(time), and the work bound at this model's shapes").

A layer's work is counted as proportional to the tokens it computes, weighted by the weights
they pass through; attention is left out (it grows with the keys a query reads, and full
prefill's causal kernel does that more efficiently than a blend's scattered queries, so it is a
gap to explain, not part of the bound). Full prefill is one unit per layer. A blend at ratio r
computes a share ``s = (round(r * cached) + fresh) / N`` of the N prompt tokens after its choice
(the selected cached tokens plus every uncached one: template, glue, question). Counted as the
engine runs it (:mod:`cacheblend_rag.engine.blend_run`):

* CacheBlend as published (choice at layer ``c`` >= 1): the ``c`` layers before it in full, the
  check layer's Q/K/V for every token and the rest for the ``s`` share, ``s`` in every later
  layer but the last, which computes K/V for the ``s`` share and its output for one token;
* a choice before layer 0 (the default, ``query_profiled``): a profile pass of the question's
  last ``profile_tokens`` through every layer, then ``s`` in every layer but the last.

The hand count of docs/performance.md and research/quality_notebook.md takes ``s = r + fresh / N`` and about
0.02 for the last layer (5.41 units, 5.2x, for Qwen2.5-1.5B at 3,000 tokens); counted as here it is 5.33
units, 5.25x: the same bound to two digits.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from cacheblend_rag.models.shapes import LayerShapes


def work_bound(
    shapes: LayerShapes, prompt_tokens: int, fresh_tokens: int, ratio: float, *, check_layer: int = 1,
    profile_tokens: int | None = None,
) -> dict[str, Any]:
    """The blend's work in layer-units against full prefill's ``num_layers``, and their quotient, the bound.

    ``check_layer`` >= 1 is CacheBlend as published; ``check_layer=0`` with ``profile_tokens`` is
    the default's choice before layer 0 after a profile pass (module docstring)."""
    n, layers, qkv = prompt_tokens, shapes.num_layers, shapes.qkv_share
    if n < 1 or not 0 <= fresh_tokens <= n:
        raise ValueError(f"prompt_tokens={prompt_tokens} must be positive and fresh_tokens={fresh_tokens} "
                         "between 0 and it")
    if not 0 <= check_layer < layers - 1:
        raise ValueError(f"check_layer={check_layer} must lie in [0, {layers - 2}] for {layers} layers")
    cached = n - fresh_tokens
    share = min(1.0, (round(ratio * cached) + fresh_tokens) / n)
    last = qkv * share + (1 - qkv) / n  # K/V for the carried tokens, the output for the last one
    if check_layer == 0:
        profile = layers * min(profile_tokens or fresh_tokens, fresh_tokens) / n
        # Chosen before layer 0, every layer computes only the carried tokens (timed as late layers).
        parts = {"profile": profile, "early_layers": 0.0, "check_layer": 0.0,
                 "late_layers": (layers - 1) * share, "last_layer": last}
    else:
        parts = {"profile": 0.0, "early_layers": float(check_layer), "check_layer": qkv + (1 - qkv) * share,
                 "late_layers": (layers - check_layer - 2) * share, "last_layer": last}
    units = sum(parts.values())
    return {"bound": layers / units, "units": units, "full_prefill_units": layers, "parts": parts,
            "recomputed_share": share, "qkv_share": qkv, "ratio": ratio, "prompt_tokens": n,
            "fresh_tokens": fresh_tokens, "check_layer": check_layer, "shapes": asdict(shapes)}
