"""K drift correction, an idea of ours for the research loop (issue 29): after a blend recomputes its chosen
tokens in a layer, move every stale key of a chunk by the mean change its recomputed tokens saw.

Why: at 1.5B a stale token's middle-layer K/V depends on the other passages, and recomputing 15% of the
tokens leaves the rest as they were. Measured on Qwen2.5-Coder-1.5B (questions 5, 8, 11, 13, 10 x 100
tokens; docs/quality.md, "K drift correction"), a shift shared by a chunk's tokens (per layer, KV head and
channel, before RoPE) explains 45-65% of its stale keys' squared error against full prefill in layers 4-26,
and the same shift estimated from the 15% a deviation selector recomputes explains 25-45% of the other
tokens' error; for values it explains 5-36% and, estimated from the recomputed tokens, next to nothing. On
SmolLM2-135M the shared part is smaller (keys 26-43%), which may be why the idea is new at this scale.

How: the change is taken before RoPE (a rotated key's change rotates with its position), averaged over the
chunk's recomputed tokens, scaled by ``alpha``, rotated to each stale token's position and added to its
key. The chosen tokens' own keys are then written as the blend always writes them. Research code: it
replaces ``BlendRun._patched_layer`` while active (for non-gradual strategies) and is not part of the package.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from cacheblend_rag.engine import blend_run

_ORIGINAL = blend_run.BlendRun._patched_layer


def _shift_stale_keys(run: blend_run.BlendRun, key_layer: torch.Tensor, fresh_rot: torch.Tensor, alpha: float) -> None:
    """Add ``alpha`` times each chunk's mean pre-RoPE key change (from its recomputed tokens) to its stale keys."""
    selected = run.selected
    if selected is None or not selected.numel():
        return
    a, cached_pos = run.a, run.layout.cached_pos
    sel_pos = cached_pos[selected]
    rows = torch.searchsorted(run.active, sel_pos)  # the chosen tokens' rows among the active ones
    delta_rot = fresh_rot[:, :, rows] - key_layer[:, :, sel_pos]
    delta = a.apply_rope(delta_rot, run.cos[:, sel_pos], -run.sin[:, sel_pos])  # rotated back: before RoPE
    for start, end in run.layout.chunk_spans:
        in_chunk = (selected >= start) & (selected < end)
        if not bool(in_chunk.any()):
            continue
        mean = delta[:, :, in_chunk].mean(dim=2, keepdim=True)
        pos = cached_pos[start:end]
        shift = a.apply_rope(mean.expand(-1, -1, end - start, -1).contiguous(), run.cos[:, pos], run.sin[:, pos])
        key_layer[:, :, pos] += alpha * shift


@contextmanager
def kshift_blend(alpha: float) -> Iterator[None]:
    """Inside, the engine's blends correct their stale keys by ``alpha`` times their chunk's mean drift."""

    def patched(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self._narrowing():
            return _ORIGINAL(self, layer, k, v)
        if self.profile is not None and self.profile.covers(layer):
            key_layer, value_layer = self.profile.keys[layer], self.profile.values[layer]
        else:
            key_layer, value_layer = self.merged.read(layer)
        fresh_rot = self.a.apply_rope(k, self.cos[:, self.active], self.sin[:, self.active])
        _shift_stale_keys(self, key_layer, fresh_rot, alpha)
        key_layer.index_copy_(2, self.active, fresh_rot)
        value_layer.index_copy_(2, self.active, v)
        return key_layer, value_layer

    blend_run.BlendRun._patched_layer = patched
    try:
        yield
    finally:
        blend_run.BlendRun._patched_layer = _ORIGINAL
