"""Oracle corrections of a blend's stale entries, for the research loop: what fixing one part of the error
exactly would buy, before anyone tries to estimate it.

A blend leaves most cached tokens *stale*: their K/V were computed with their chunk alone. Full prefill's
per-layer K/V (the research loop's reference) says what they should have been. After each layer that a blend
patches, an oracle moves the stale entries towards the reference:

- ``k_full`` / ``v_full`` / ``kv_full``: the stale keys, values or both replaced by full prefill's. This
  separates the keys' part of the loss from the values'.
- ``k_shift`` / ``v_shift`` / ``kv_shift``: each chunk's stale entries moved by the one shift (per KV head and
  channel, keys before RoPE) that best fits their error, the mean of it: the ceiling of the engine's
  ``stale_key_correction``, and of a value correction built the same way.
- ``kv_shape``: each chunk's mean error plus the prompt's mean departure from it at the token's offset bucket
  (``oracle_window`` tokens wide, default 10), pooled over every chunk: the ceiling of ``shift_offset_profile``.

``layers`` (``"a-b"``, inclusive) limits it to those layers; ``window`` (``oracle_window``) gives the shift modes
one shift per window of that many tokens of a chunk, as the engine's ``shift_window`` does for its estimate;
``sample`` (``oracle_sample``) takes each of those shifts from the exact errors of the stale tokens at every
``sample``-th offset only, to see how many known errors a window needs (``oracle_sample=K/P``: at the offsets
``P`` modulo ``K``; ``K`` alone: one token past half a stride, beside the probes' places; a window without such a
token keeps the blend's own estimate). Not an oracle, but patched the same way:
``keyshift_layers`` applies the engine's ``stale_key_correction`` only in a range of layers, and
``keyshift_tau`` makes its estimate local: each stale key moves by its chunk's recomputed keys' changes
weighted by ``exp(-distance / tau)`` in tokens, instead of by their plain mean; ``keyshift_fit=diag``
predicts each stale key's change from the key itself, ``a * k + b_chunk`` per channel, fitted on the
recomputed tokens. ``shift_estimate`` replaces the plain mean of the probes' changes (keys and values) by a
robust one: ``median`` (per head and channel), ``clip`` (the mean without the probes whose change is over
twice its group's median size), ``shrink`` (each group's mean halfway to the mean of every group's) or
``wiener`` (each group's mean per head and channel scaled by ``m^2 / (m^2 + se^2)``, its standard error from
the spread of every group's probes around their own means, pooled: a shift the probes agree on is applied
whole, one they do not is dropped) or ``splithalf`` (each group's mean per KV head scaled by its split-half
reliability: the cosine ``r`` between the means of its even and odd probes, stepped up to the whole set as
``2r / (1 + r)`` and clipped to 0-1; one vector's agreement, where ``wiener`` judges each channel alone) or
``cap`` (each group's mean per KV head no longer than 1.5 times the median length of every group's in that
layer: a trust region against the one chunk whose estimate runs away).
``probe_offset`` places each chunk's first probe that many tokens in (the engine: half the stride), to see how
much the probes' placement alone moves a result. Estimates finer than a group's mean
(research/quality_notebook.md, "Estimates of the shift beyond the probes' mean"): ``shift_kernel`` (a similarity-weighted mean of the group's probes),
``shift_slope`` (the mean plus a slope pooled over the prompt; ``shift_slope_on=position|logposition`` on the
token's offset in its chunk), ``shift_poskernel`` (the probes weighted by how near they sit to the token in its
chunk; "Where the shipped setting's probes fall") and ``deviation_residual`` (the deviation selector
scoring a token's change less its chunk's mean). ``shift_truth``, a diagnostic, gives the probes their exact errors
in place of their changes in the blend. Research code: it patches ``BlendRun`` while active and is not
part of the package.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from cacheblend_rag.engine.blend_run import BlendRun

ORACLE_OPTIONS = ("oracle", "oracle_layers", "oracle_window", "oracle_sample", "keyshift_layers", "keyshift_tau",
                  "keyshift_fit", "shift_estimate", "probe_offset", "shift_kernel", "shift_kernel_on",
                  "shift_kernel_pool", "deviation_residual", "shift_slope", "shift_slope_on", "shift_slope_pool",
                  "shift_poskernel", "profile_source", "profile_rank", "lead_tokens", "shift_offset_profile",
                  "shift_local", "shift_shape", "shift_truth")
SHIFT_ESTIMATES = ("median", "clip", "shrink", "wiener", "splithalf", "cap")
MODES = ("k_full", "v_full", "kv_full", "k_shift", "v_shift", "kv_shift", "kv_shape")


@dataclass(frozen=True)
class OracleSetting:
    mode: str
    first_layer: int = 0
    last_layer: int = 10**6
    window: int = 0  # the shift modes: one shift per window of this many tokens of a chunk (0: the whole chunk)
    sample: int = 0  # the shift modes: each shift from the stale tokens at every ``sample``-th offset only (0: all)
    sample_phase: int = -1  # at the offsets ``sample_phase`` modulo ``sample`` (-1: one past half a stride)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"oracle={self.mode!r}: choose one of {', '.join(MODES)}")
        if self.window < 0:
            raise ValueError(f"oracle_window={self.window}: a number of tokens, or 0 for the whole chunk")
        if self.sample < 0 or (self.sample and self.mode not in ("k_shift", "v_shift", "kv_shift")):
            raise ValueError(f"oracle_sample={self.sample}: a stride in tokens for the *_shift modes, or 0 for all")
        if self.sample and not -1 <= self.sample_phase < self.sample:
            raise ValueError(f"oracle_sample={self.sample}/{self.sample_phase}: the phase is an offset below the stride")

    @classmethod
    def parse(cls, mode: str, layers: str | None, window: int | str | None = None,
              sample: int | str | None = None) -> "OracleSetting":
        first, last = 0, 10**6
        if layers:
            head, _, tail = str(layers).partition("-")
            first, last = int(head), int(tail or head)
        stride, _, phase = str(sample or 0).partition("/")
        return cls(mode, first, last, int(window or 0), int(stride), int(phase or -1))


def group_means(diff: torch.Tensor, group_of: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``diff`` ``[heads, tokens, d]``, ``group_of`` ``[tokens]``: each group's mean of ``diff``,
    ``[heads, n_groups, d]`` (a group without tokens: zero)."""
    totals = diff.new_zeros(diff.shape[0], n_groups, diff.shape[2])
    totals.index_add_(1, group_of, diff)
    counts = torch.bincount(group_of, minlength=n_groups).clamp(min=1)
    return totals / counts.view(1, -1, 1)


def chunk_means(diff: torch.Tensor, chunk_of: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """``diff`` ``[heads, tokens, d]``, ``chunk_of`` ``[tokens]``: each token's chunk mean of ``diff``."""
    return group_means(diff, chunk_of, n_chunks)[:, chunk_of]


def correct(run: BlendRun, layer: int, key_layer: torch.Tensor, value_layer: torch.Tensor,
            reference: list[tuple[torch.Tensor, torch.Tensor]], setting: OracleSetting) -> None:
    """Move ``layer``'s stale entries (cached, not active) towards ``reference`` in place."""
    if not setting.first_layer <= layer <= setting.last_layer:
        return
    layout = run.layout
    chunk_of = torch.full((layout.n_cached,), -1, dtype=torch.long)
    groups = 0
    # ``kv_shape``: one level per chunk, the departures from it shared by the prompt's chunks by offset bucket
    # (``oracle_window`` is the bucket's width there).
    shape = setting.mode.endswith("_shape")
    for start, end in layout.chunk_spans:
        width = (end - start) if shape or not setting.window else setting.window
        chunk_of[start:end] = groups + torch.arange(end - start) // width
        groups += -(-(end - start) // width)
    stale = ~torch.isin(layout.cached_pos, run.active) & (chunk_of >= 0)
    pos, chunk_of, offsets = layout.cached_pos[stale], chunk_of[stale], chunk_offsets(run)[stale]
    if shape:
        bucket = offsets // (setting.window or 10)
    ref_k, ref_v = reference[layer]
    full = setting.mode.endswith("_full")

    # ``oracle_sample``: the shift that a few stale tokens' exact errors give, to see how many a window needs; by
    # default one token past half a stride, beside the probes' places rather than on them (a probe is never stale).
    phase = setting.sample_phase
    if setting.sample and phase < 0:
        phase = (setting.sample // 2 + 1) % setting.sample
    sampled = (offsets % setting.sample == phase) if setting.sample else None

    def shift_of(diff: torch.Tensor) -> torch.Tensor:
        if sampled is not None:
            return group_means(diff[:, sampled], chunk_of[sampled], groups)[:, chunk_of]
        means = chunk_means(diff, chunk_of, groups)
        if not shape:
            return means
        return means + chunk_means(diff - means, bucket, int(bucket.max()) + 1)

    if "k" in setting.mode.split("_")[0]:
        cur = key_layer[0, :, pos].float()
        target = ref_k[:, pos].float()
        if full:
            new = target
        else:
            cos, sin = run.cos[:, pos].float(), run.sin[:, pos].float()
            diff = run.a.apply_rope((target - cur).unsqueeze(0), cos, -sin)[0]
            shift = run.a.apply_rope(shift_of(diff).unsqueeze(0), cos, sin)[0]
            new = cur + shift
        key_layer[0, :, pos] = new.to(key_layer.dtype)
    if "v" in setting.mode.split("_")[0]:
        cur = value_layer[0, :, pos].float()
        target = ref_v[:, pos].float()
        new = target if full else cur + shift_of(target - cur)
        value_layer[0, :, pos] = new.to(value_layer.dtype)


@contextmanager
def attribute_replaced(owner: Any, attribute: str, value: Any) -> Iterator[None]:
    """``owner.attribute`` is ``value`` while active (the research patches of ``BlendRun`` and APE's)."""
    original = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def oracle_blend(reference: list[tuple[torch.Tensor, torch.Tensor]], setting: OracleSetting) -> AbstractContextManager[None]:
    """Every blend run inside gets ``setting``'s oracle after each patched layer."""
    original = BlendRun._patched_layer

    def patched(self: BlendRun, layer: int, k: torch.Tensor, v: torch.Tensor):
        key_layer, value_layer = original(self, layer, k, v)
        correct(self, layer, key_layer, value_layer, reference, setting)
        return key_layer, value_layer

    return attribute_replaced(BlendRun, "_patched_layer", patched)


def key_correction_layers(first: int, last: int) -> AbstractContextManager[None]:
    """The engine's ``stale_key_correction`` applied only in layers ``first``..``last`` (inclusive)."""
    original = BlendRun._patched_layer

    def patched(self: BlendRun, layer: int, k: torch.Tensor, v: torch.Tensor):
        full = getattr(self, "_research_key_correction", self.key_correction)
        self._research_key_correction = full
        self.key_correction = full if first <= layer <= last else 0.0
        return original(self, layer, k, v)

    return attribute_replaced(BlendRun, "_patched_layer", patched)


def local_key_correction(tau: float) -> AbstractContextManager[None]:
    """``stale_key_correction`` with each token's estimate from its chunk's recomputed tokens, nearest
    weighted most (``exp(-|distance| / tau)``), instead of the chunk's plain mean."""

    def local_shift(self: BlendRun, key_layer: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
        selected, cached_pos = self.selected, self.layout.cached_pos
        same_chunk = self.chunk_of[:, None] == self.chunk_of[selected][None, :]
        distance = (cached_pos[:, None] - cached_pos[selected][None, :]).abs().float()
        weights = torch.exp(-distance / tau) * same_chunk
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1e-30)
        return torch.einsum("ts,bhsd->bhtd", weights, change)

    return attribute_replaced(BlendRun, "_stale_key_shift", local_shift)


def affine_key_correction() -> AbstractContextManager[None]:
    """``stale_key_correction`` with each stale key's change predicted from the key itself: per layer, KV
    head and channel ``change = a * key + b[chunk]`` (keys before RoPE), least squares over the recomputed
    tokens (``a`` shared by the chunks, ``b`` each chunk's)."""

    def affine_shift(self: BlendRun, key_layer: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
        selected, cached_pos = self.selected, self.layout.cached_pos
        stale_keys = self.a.apply_rope(key_layer[:, :, cached_pos].float(), self.cos[:, cached_pos].float(),
                                       -self.sin[:, cached_pos].float())  # [1, heads, cached, d]
        k_sel = stale_keys[:, :, selected]
        n_chunks = len(self.layout.chunk_spans)
        chunks = self.chunk_of[selected]
        counts = torch.bincount(chunks, minlength=n_chunks).clamp(min=1).view(1, 1, -1, 1).float()

        def chunk_mean(x: torch.Tensor) -> torch.Tensor:
            totals = x.new_zeros(x.shape[0], x.shape[1], n_chunks, x.shape[3])
            totals.index_add_(2, chunks, x)
            return totals / counts

        mean_change, mean_key = chunk_mean(change), chunk_mean(k_sel)
        centred_change = change - mean_change[:, :, chunks]
        centred_key = k_sel - mean_key[:, :, chunks]
        a = (centred_change * centred_key).sum(dim=2, keepdim=True) / centred_key.pow(2).sum(
            dim=2, keepdim=True).clamp(min=1e-12)
        b = mean_change - a * mean_key
        return a * stale_keys + b[:, :, self.chunk_of]

    return attribute_replaced(BlendRun, "_stale_key_shift", affine_shift)


def robust_shift_estimate(mode: str) -> AbstractContextManager[None]:
    """The stale shifts estimated robustly from each group's estimating tokens (``SHIFT_ESTIMATES``): a few
    probes carry the estimate, and one unusual token among them moves the whole group."""
    if mode not in SHIFT_ESTIMATES:
        raise ValueError(f"shift_estimate={mode!r}: choose one of {', '.join(SHIFT_ESTIMATES)}")

    def robust_means(self: BlendRun, change: torch.Tensor) -> torch.Tensor:
        assert self.estimators is not None
        groups = self.chunk_of[self.estimators]
        out = change.new_zeros(change.shape[0], change.shape[1], self.shift_groups, change.shape[3])
        everything = change.mean(dim=2)
        members_of = torch.bincount(groups, minlength=self.shift_groups)
        counts = members_of.clamp(min=1).view(1, 1, -1, 1)
        means = change.new_zeros(out.shape).index_add_(2, groups, change) / counts  # the engine's, per group
        if mode == "wiener":
            spread = (change - means[:, :, groups]).pow(2).sum(dim=2, keepdim=True)
            variance = spread / max(change.shape[2] - self.shift_groups, 1)
            square = means.pow(2)
            return (means * square / (square + variance / counts).clamp(min=1e-30))[:, :, self.chunk_of]
        if mode == "cap":
            length = means.norm(dim=-1, keepdim=True)  # [1, kv_heads, groups, 1]
            limit = 1.5 * length[:, :, members_of > 0].median(dim=2, keepdim=True).values
            return (means * (limit / length.clamp(min=1e-12)).clamp(max=1))[:, :, self.chunk_of]
        for g in range(self.shift_groups):
            members = change[:, :, groups == g]
            if not members.shape[2]:
                continue
            if mode == "median":
                out[:, :, g] = members.median(dim=2).values
            elif mode == "splithalf":
                mean = members.mean(dim=2)
                if members.shape[2] < 2:
                    out[:, :, g] = mean  # one probe: nothing to judge it by, as the engine would
                    continue
                even, odd = members[:, :, 0::2].mean(dim=2), members[:, :, 1::2].mean(dim=2)
                r = torch.nn.functional.cosine_similarity(even, odd, dim=-1)
                reliability = (2 * r / (1 + r).clamp(min=1e-6)).clamp(0, 1)
                out[:, :, g] = reliability.unsqueeze(-1) * mean
            elif mode == "clip":
                size = members.norm(dim=(1, 3)).flatten()  # one size per estimating token
                keep = size <= 2 * size.median()
                out[:, :, g] = members[:, :, keep].mean(dim=2)
            else:
                out[:, :, g] = 0.5 * (members.mean(dim=2) + everything)
        return out[:, :, self.chunk_of]

    return attribute_replaced(BlendRun, "_chunk_means", robust_means)


def probes_offset(first: int) -> AbstractContextManager[None]:
    """``shift_probe_stride``'s probes starting ``first`` tokens into each chunk instead of half a stride in."""
    from cacheblend_rag.engine import blend_run

    def placed(chunk_spans, stride: int) -> list[int]:
        if not stride:
            return []
        return [i for start, end in chunk_spans for i in range(start + first, end, stride)]

    return attribute_replaced(blend_run, "probe_list", placed)


def similar_shift(beta: float, feature: str = "key", pool: str = "probes") -> AbstractContextManager[None]:
    """Each stale entry moved by its chunk's estimating tokens' changes weighted by how alike they are,
    ``softmax(beta * cos(x_token, x_estimator))`` per KV head over the chunk's estimators, where ``x`` is the
    stale key before RoPE (``feature="key"``) or the stale value (``"value"``), read before any of this
    layer's writes: a kernel regression on the probes instead of their plain mean (``beta=0``: the mean).
    ``pool="all"`` lets every recomputed token of the chunk estimate, not only the probes: the kernel is
    meant to keep the selector's unusual tokens from speaking for ordinary ones."""
    if feature not in ("key", "value") or pool not in ESTIMATOR_POOLS:
        raise ValueError(f"shift_kernel_on={feature!r} (key or value), shift_kernel_pool={pool!r} "
                         f"(one of {', '.join(ESTIMATOR_POOLS)})")

    def weighted(self: BlendRun, kind: str, stale_keys: torch.Tensor, stale_values: torch.Tensor,
                 change: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.normalize(stale_keys if feature == "key" else stale_values, dim=-1)
        sim = x @ x[:, :, self.estimators].transpose(-1, -2)  # [1, kv_heads, cached, estimators]
        return group_kernel(self, beta * sim, change)

    return stale_correction(weighted, pool)


# Which recomputed tokens estimate the stale shift: the probes; every recomputed token; or every one but each
# chunk's first token, a sink when the chunk is computed alone, whose change is no other token's.
ESTIMATOR_POOLS = ("probes", "all", "nonsink")


def group_kernel(run: BlendRun, logits: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
    """Each cached token's estimate: the estimators' ``change`` weighted by ``softmax(logits)`` over the
    estimators of its own shift group (``logits`` ``[..., cached, estimators]``); a group without estimators:
    no change."""
    same = run.chunk_of.unsqueeze(1) == run.chunk_of[run.estimators].unsqueeze(0)
    return torch.softmax(logits.masked_fill(~same, float("-inf")), dim=-1).nan_to_num(0.0) @ change


def stale_correction(shift_of: Any, pool: str) -> AbstractContextManager[None]:
    """The engine's ``_correct_stale_entries`` with its per-group mean replaced by ``shift_of(run, kind,
    stale_keys, stale_values, change)``: every blendable cached token's estimated change (``kind`` "key", before
    RoPE, or "value") from the estimators' ``change``, given every cached token's stale keys (before RoPE) and
    values as read before this layer's writes. ``pool="all"``: every recomputed token estimates, not the probes
    alone."""

    def correct(self: BlendRun, key_layer: torch.Tensor, value_layer: torch.Tensor, fresh_keys: torch.Tensor,
                fresh_values: torch.Tensor) -> None:
        selected, layout = self.selected, self.layout
        if selected is None or not selected.numel() or not layout.chunk_spans:
            return
        if pool == "probes" and self.probes.numel():
            self.estimators = self.probes[torch.isin(self.probes, selected)]
        elif pool == "nonsink":
            starts = torch.tensor([start for start, _ in layout.chunk_spans], device=selected.device)
            self.estimators = selected[~torch.isin(selected, starts)]
        else:
            self.estimators = selected
        if not self.estimators.numel():
            return
        cached_pos = layout.cached_pos
        pos = cached_pos[self.estimators]
        rows = torch.searchsorted(self.active, pos)
        stale_keys = self.a.apply_rope(key_layer[:, :, cached_pos].float(), self.cos[:, cached_pos].float(),
                                       -self.sin[:, cached_pos].float())
        stale_values = value_layer[:, :, cached_pos].float()
        if self.key_correction:
            change = fresh_keys[:, :, rows] - key_layer[:, :, pos]
            change = self.a.apply_rope(change.float(), self.cos[:, pos].float(), -self.sin[:, pos].float())
            self._shift_cached_keys(key_layer, shift_of(self, "key", stale_keys, stale_values, change))
        if self.value_correction:
            change = fresh_values[:, :, rows].float() - stale_values[:, :, self.estimators]
            shift = self.value_correction * shift_of(self, "value", stale_keys, stale_values, change)
            value_layer.index_add_(2, cached_pos, shift.to(value_layer.dtype))

    return attribute_replaced(BlendRun, "_correct_stale_entries", correct)


def residual_deviation() -> AbstractContextManager[None]:
    """The deviation selectors score each token by its K/V change at the check layer less its chunk's mean
    change: with the stale entries moved by their chunk's (probes') mean shift, what a stale token keeps wrong
    is its own change's departure from that mean, so that is what the budget should buy back."""
    from cacheblend_rag.engine.selection import SelectionContext

    def scores(self: SelectionContext, kind: str = "value") -> torch.Tensor:
        fresh, cached = (self.fresh_v, self.cached_v) if kind == "value" else (self.fresh_k, self.cached_k)
        diff = fresh.float() - cached.float()
        for start, end in self.chunk_spans:
            diff[:, start:end] -= diff[:, start:end].mean(dim=1, keepdim=True)
        return diff.pow(2).sum(dim=(0, 2))

    return attribute_replaced(SelectionContext, "deviation_scores", scores)


def sloped_shift(kind: str, feature: str = "own", pool: str = "probes") -> AbstractContextManager[None]:
    """Each stale entry moved by its group's probes' mean change plus a slope on how far the entry itself sits
    from the probes' mean: ``change_t = mean_g(change) + a * (x_t - mean_g(x))``, ``x`` the stale key before
    RoPE for the keys' change and the stale value for the values'. The slope ``a`` is pooled over every group
    of the prompt (a within-group regression on all probes), per KV head and channel (``kind="channel"``) or
    one per KV head (``"head"``): a chunk's ten probes cannot fit a slope of their own, a prompt's hundred can.
    The plain mean is ``a = 0``. ``feature="deviation"`` (or ``"logdeviation"``, its log) regresses on a number
    every token has without a recompute instead: its value deviation at the check layer, where every token was
    computed, per channel. With ``pool="all"`` every recomputed token estimates, not only the probes: the
    deviation selector picks tokens by that very number, so a slope on it is what would let its biased picks
    estimate the shift for the ordinary tokens."""
    if kind not in ("channel", "head") or feature not in ("own", "deviation", "logdeviation", "position",
                                                          "logposition"):
        raise ValueError(f"shift_slope={kind!r}: channel or head; shift_slope_on={feature!r}: own, deviation, "
                         "logdeviation, position or logposition")
    if pool not in ("probes", "all"):
        raise ValueError(f"shift_slope_pool={pool!r}: probes or all")
    original_select = BlendRun._select

    def select_and_keep_deviation(self: BlendRun, ctx: Any) -> torch.Tensor:
        if ctx.num_cached == self.layout.n_cached:
            self.check_deviation = ctx.deviation_scores("value").sqrt()
        return original_select(self, ctx)

    def deviation_feature(self: BlendRun, like: torch.Tensor) -> torch.Tensor:
        d = self.check_deviation.to(like.device, torch.float32)
        d = torch.log(d + 1e-6) if feature == "logdeviation" else d
        return d.view(1, 1, -1, 1).expand_as(like)

    def fitted(self: BlendRun, x: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
        """``x`` ``[1, kv_heads, cached, d]`` (every blendable cached token's stale feature), ``change`` the
        estimators'; one predicted change per cached token."""
        assert self.estimators is not None
        groups = self.chunk_of[self.estimators]
        counts = torch.bincount(groups, minlength=self.shift_groups).clamp(min=1).view(1, 1, -1, 1)

        def group_mean(values: torch.Tensor) -> torch.Tensor:
            totals = values.new_zeros(values.shape[0], values.shape[1], self.shift_groups, values.shape[3])
            return totals.index_add_(2, groups, values) / counts

        xe = x[:, :, self.estimators]
        mean_x, mean_change = group_mean(xe), group_mean(change)
        cx, cy = xe - mean_x[:, :, groups], change - mean_change[:, :, groups]
        dims = (2,) if kind == "channel" else (2, 3)
        slope = (cx * cy).sum(dim=dims, keepdim=True) / cx.pow(2).sum(dim=dims, keepdim=True).clamp(min=1e-12)
        has = torch.zeros(self.shift_groups, dtype=torch.bool, device=x.device)
        has[groups] = True
        out = mean_change[:, :, self.chunk_of] + slope * (x - mean_x[:, :, self.chunk_of])
        return out * has[self.chunk_of].view(1, 1, -1, 1)  # a group without estimators: no change

    def sloped(self: BlendRun, kind: str, stale_keys: torch.Tensor, stale_values: torch.Tensor,
               change: torch.Tensor) -> torch.Tensor:
        own = stale_keys if kind == "key" else stale_values
        if feature in ("position", "logposition"):
            offset = chunk_offsets(self).to(own.device, torch.float32)
            offset = torch.log1p(offset) if feature == "logposition" else offset
            return fitted(self, offset.view(1, 1, -1, 1).expand_as(own), change)
        return fitted(self, own if feature == "own" else deviation_feature(self, own), change)

    if feature in ("own", "position", "logposition"):
        return stale_correction(sloped, pool)
    return _both(stale_correction(sloped, pool), attribute_replaced(BlendRun, "_select", select_and_keep_deviation))


def chunk_offsets(run: BlendRun) -> torch.Tensor:
    """Each blendable cached token's offset from its chunk's first token (0 outside the chunks)."""
    offsets = torch.zeros(run.layout.n_cached, dtype=torch.long)
    for start, end in run.layout.chunk_spans:
        offsets[start:end] = torch.arange(end - start)
    return offsets


def positional_shift(length: float) -> AbstractContextManager[None]:
    """Each stale entry moved by its group's probes' changes weighted by ``exp(-|offset - offset_probe| /
    length)``: a kernel in the token's place within its chunk instead of in its key. A token early in its
    chunk computed alone attended to few tokens, one late to many, so its error may follow its place; a
    window (``shift_window``) is the same idea in steps. ``length`` large: the group's mean."""
    if length <= 0:
        raise ValueError(f"shift_poskernel={length}: a length in tokens, above 0")

    def weighted(self: BlendRun, kind: str, stale_keys: torch.Tensor, stale_values: torch.Tensor,
                 change: torch.Tensor) -> torch.Tensor:
        offset = chunk_offsets(self).to(change.device, torch.float32)
        distance = (offset.unsqueeze(1) - offset[self.estimators].unsqueeze(0)).abs()
        return group_kernel(self, -distance / length, change)

    return stale_correction(weighted, "probes")


def pooled_offset_shift(width: int) -> AbstractContextManager[None]:
    """Each stale entry moved by its group's probes' mean plus the prompt's *shape* at its place: the probes'
    departures from their own group's mean, averaged over every chunk of the prompt by the offset bucket
    (``offset // width``, from the chunk's first token) they sit in, added at the token's bucket. The oracles
    put one exact shift per window of 25 tokens at 84% where one per chunk gives 71% (@0.2 at 100-token
    passages): the error drifts along a chunk. A window's own two or three probes estimate that drift too
    noisily (``shift_poskernel``); pooled over ten chunks, a bucket's departure rests on ten probes, on the bet
    that the drift's shape is the prompt's (a chunk's first tokens lost the most when it was computed alone)
    while its level is the chunk's."""
    if width <= 0:
        raise ValueError(f"shift_offset_profile={width}: a bucket width in tokens, above 0")

    def shaped(self: BlendRun, kind: str, stale_keys: torch.Tensor, stale_values: torch.Tensor,
               change: torch.Tensor) -> torch.Tensor:
        means = self._chunk_means(change)  # [1, heads, cached, d]
        bucket = chunk_offsets(self).to(change.device) // width
        departure = change - means[:, :, self.estimators]
        profile = group_means(departure[0], bucket[self.estimators], int(bucket.max()) + 1)
        return means + profile[:, bucket].unsqueeze(0)

    return stale_correction(shaped, "probes")


def local_shift(mode: str) -> AbstractContextManager[None]:
    """Each stale entry moved by its group's probes' mean plus a share ``lam`` of its nearest probe's departure
    from that mean (the nearest in its own group). The oracles put one exact shift per 10-token window at 82% on
    the shipped selection where one per chunk gives 59%: most of what a chunk's mean misses is local. One
    probe's departure is that local drift plus the probe's own error, which no neighbour shares. ``adaptive``
    weighs the two by how much neighbouring probes agree: per layer and KV head, ``lam`` is the covariance of
    adjacent probes' departures (the drift they share) over their variance (drift and own error), clipped to
    0-1, the kriging weight of a drift that is smooth over a probe stride. ``nearest`` takes the whole
    departure (``lam = 1``), the window-of-one-probe estimate."""
    if mode not in ("adaptive", "nearest"):
        raise ValueError(f"shift_local={mode!r}: choose adaptive or nearest")

    def shifted(self: BlendRun, kind: str, stale_keys: torch.Tensor, stale_values: torch.Tensor,
                change: torch.Tensor) -> torch.Tensor:
        means = self._chunk_means(change)  # [1, heads, cached, d]
        estimators = self.estimators
        group = self.chunk_of[estimators]
        departure = change - means[:, :, estimators]
        if mode == "nearest":
            lam = change.new_ones(change.shape[0], change.shape[1], 1, 1)
        else:
            adjacent = group[1:] == group[:-1]
            if not bool(adjacent.any()):
                return means
            shared = (departure[:, :, :-1] * departure[:, :, 1:]).sum(-1)[:, :, adjacent].mean(-1)
            total = (departure * departure).sum(-1).mean(-1).clamp(min=1e-12)
            lam = (shared / total).clamp(0.0, 1.0)[..., None, None]
        cached = torch.arange(self.layout.n_cached, device=change.device)
        distance = (cached.unsqueeze(1) - estimators.unsqueeze(0)).abs().float()
        same = self.chunk_of.unsqueeze(1) == group.unsqueeze(0)
        distance = distance.masked_fill(~same, float("inf"))
        nearest = distance.argmin(dim=1)
        has_probe = same.any(dim=1).view(1, 1, -1, 1)
        return means + lam * departure[:, :, nearest] * has_probe

    return stale_correction(shifted, "probes")


def conditioned_shape(plain: list[Any], conditioned: list[Any], width: int) -> AbstractContextManager[None]:
    """Each stale entry moved by its group's probes' mean plus a shape measured offline: how far each ``width``-token
    window of its chunk moved from the chunk's mean when the chunk was computed behind a prefix (``conditioned``,
    the lead and a stand-in passage) instead of alone (``plain``). The oracles put one exact shift per 10-token
    window at 82% on the shipped selection (one per chunk: 59%), and the probes are too few to see a window's
    drift; this bets that a chunk's windows drift the same way behind any context, so that a stored shape per
    window and an online level per chunk would do. Keys are compared before RoPE, as stored."""
    if width <= 0:
        raise ValueError(f"shift_shape={width}: a window width in tokens, above 0")
    offsets = torch.cat([torch.arange(len(c)) for c in plain])
    chunk = torch.cat([torch.full((len(c),), i, dtype=torch.long) for i, c in enumerate(plain)])
    # Windows must nest in the blend's shift groups (``width`` divides ``shift_window``) to be departures from them.
    window = chunk * (int(offsets.max()) // width + 1) + offsets // width

    deltas = {kind: [torch.cat([getattr(c, attr)[layer].float() - getattr(p, attr)[layer].float()
                                for p, c in zip(plain, conditioned)], dim=1)  # [heads, cached, d]
                     for layer in range(plain[0].num_layers)]
              for kind, attr in (("key", "keys"), ("value", "values"))}

    def shaped(self: BlendRun, kind: str, stale_keys: torch.Tensor, stale_values: torch.Tensor,
               change: torch.Tensor) -> torch.Tensor:
        delta = deltas[kind][len(self.keys)]  # the layer being patched: its K/V are appended after the patch
        # A window's departure from its shift group's mean (the chunk, or its ``shift_window``), which the
        # probes level online.
        shape = chunk_means(delta, window, int(window.max()) + 1) - chunk_means(delta, self.chunk_of, self.shift_groups)
        return self._chunk_means(change) + shape.unsqueeze(0).to(change.device)

    return stale_correction(shaped, "probes")


def probe_truth_shift(reference: list[tuple[torch.Tensor, torch.Tensor]]) -> AbstractContextManager[None]:
    """A diagnostic, not an estimate: each shift group's stale entries moved by its probes' *exact* errors (full
    prefill's K/V at the probes less their stale K/V) instead of by the probes' changes in the blend. It splits
    what keeps the probes from a window's shift in two: if the exact errors of one probe a window recover what the
    window oracle does, the probes' recompute is what misleads them (it saw a blend, not the whole prompt); if not,
    one token's error is no estimate of its window's, however exactly it is known."""

    def exact(self: BlendRun, kind: str, stale_keys: torch.Tensor, stale_values: torch.Tensor,
              change: torch.Tensor) -> torch.Tensor:
        ref_k, ref_v = reference[len(self.keys)]  # the layer being patched: its K/V are appended after the patch
        pos = self.layout.cached_pos[self.estimators]
        if kind == "key":
            cos, sin = self.cos[:, pos].float(), self.sin[:, pos].float()
            truth = self.a.apply_rope(ref_k[:, pos].float().unsqueeze(0).to(stale_keys.device), cos, -sin)
            return self._chunk_means(truth - stale_keys[:, :, self.estimators])
        truth = ref_v[:, pos].float().unsqueeze(0).to(stale_values.device)
        return self._chunk_means(truth - stale_values[:, :, self.estimators])

    return stale_correction(exact, "probes")


@contextmanager
def _both(first: AbstractContextManager[None], second: AbstractContextManager[None]) -> Iterator[None]:
    with first, second:
        yield


PROFILE_RANKS = ("corrected", "change")


def corrected_profile(first_pass: Any, rank: str = "corrected") -> AbstractContextManager[None]:
    """The profile's ranking of the cached tokens, measured over a corrected cache instead of the stale one.

    ``first_pass()`` runs a blend (the probes with their shifts, at a small ratio) and returns its decoding cache;
    while active, every profile pass keeps its own stale merged K/V, which the blend builds on, but ranks the
    tokens by the question's attention over that cache's layers. The reading it tests: at 1.5B the full-reuse
    profile looks through stale late-layer keys, so it may rank the wrong tokens. Its cost, were it built, is the
    probes' recompute once more (or their K/V carried over) and a second profile pass.

    ``rank="change"`` ranks by how far the question's attention moves between the two caches instead,
    ``|corrected - stale|``: the tokens whose stale K/V mislead the question most, read too much or too little."""
    if rank not in PROFILE_RANKS:
        raise ValueError(f"profile_rank={rank!r}: choose one of {', '.join(PROFILE_RANKS)}")
    from cacheblend_rag.engine import blend_run
    from cacheblend_rag.engine.profile import Profile

    cache = first_pass()
    original = blend_run.profile_question

    class CorrectedLayers:
        def __init__(self, merged: Any) -> None:
            self.cos, self.sin = merged.cos, merged.sin

        def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            slot = cache.layers[layer]
            return slot.keys.clone(), slot.values.clone()

    def profiled(a: Any, layout: Any, merged: Any, layers: int, question_tokens: int | None) -> Profile:
        stale = original(a, layout, merged, layers, question_tokens)
        corrected = original(a, layout, CorrectedLayers(merged), layers, question_tokens)
        ranking = corrected.question_attention
        if rank == "change":
            ranking = (ranking - stale.question_attention).abs()
        return Profile(keys=stale.keys, values=stale.values, question_attention=ranking)

    return attribute_replaced(blend_run, "profile_question", profiled)


def chunk_lead_tokens(n: int) -> AbstractContextManager[None]:
    """``query_profiled`` takes each chunk's first ``n`` tokens (among those it may choose: the probes are already
    in) before ranking the rest by the question's attention. A chunk computed alone gives its first tokens almost
    nothing to attend to, so their K/V are the furthest from full prefill's; the profile ranks by what the
    question reads and may leave them stale, where plain CacheBlend's deviation picks them."""
    from cacheblend_rag.engine.selection import QueryProfiled, chunk_starts_first, top_indices

    def select(self: QueryProfiled, ctx: Any) -> torch.Tensor:
        return top_indices(chunk_starts_first(ctx.question_attention().float(), ctx.chunk_spans, n), ctx.budget)

    return attribute_replaced(QueryProfiled, "select", select)
