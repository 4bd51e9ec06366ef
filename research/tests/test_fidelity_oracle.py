"""The research loop's oracle corrections and local key correction (research/fidelity_oracle.py,
research/quality_notebook.md "Where the 1.5B model's loss sits"): an exact oracle turns any blend into full prefill,
a partial one touches only what it names, and the local estimate with an infinite width is the engine's
per-chunk mean."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from cacheblend_rag import BlendConfig


@pytest.fixture(scope="module")
def oracle(research_module):
    with research_module("fidelity_oracle") as module:
        yield module


@pytest.fixture(scope="module")
def setup(three_chunk_prompt):
    engine, lead, chunks, full, blend = three_chunk_prompt
    reference = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in full.cache.layers]
    return engine, full, reference, blend, len(lead), sum(len(c) for c in chunks)


CB = BlendConfig(selection="kv_deviation", recompute_ratio=0.2)


def test_exact_keys_and_values_make_any_blend_full_prefill(oracle, setup):
    _, full, reference, blend, _, _ = setup
    plain = blend(CB)
    assert not torch.allclose(plain.logits, full.logits, atol=1e-3)
    with oracle.oracle_blend(reference, oracle.OracleSetting("kv_full")):
        fixed = blend(CB)
    torch.testing.assert_close(fixed.logits, full.logits, atol=2e-4, rtol=1e-4)


def test_a_partial_oracle_touches_only_what_it_names(oracle, setup):
    _, _, reference, blend, first, n = setup
    plain = blend(CB)
    stale = torch.ones(len(reference[0][0][0]), dtype=torch.bool)
    stale[:] = False
    stale[first:first + n] = True
    stale[torch.tensor(plain.stats.selected_positions, dtype=torch.long)] = False
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("k_full", "3-3")):
        keys_only = blend(CB)
    for layer, (ref_k, ref_v) in enumerate(reference):
        got = keys_only.cache.layers[layer]
        if layer == 3:  # the stale keys are full prefill's, their values the blend's own
            torch.testing.assert_close(got.keys[0][:, stale], ref_k[:, stale])
            assert not torch.allclose(got.values[0][:, stale], ref_v[:, stale], atol=1e-4)
        if layer < 3:  # layers before the oracle's range are the plain blend's
            torch.testing.assert_close(got.keys[0], plain.cache.layers[layer].keys[0])
    with pytest.raises(ValueError, match="oracle="):
        oracle.OracleSetting("q_full")


def test_a_chunk_shift_leaves_the_stale_error_with_zero_mean(oracle, setup):
    engine, _, reference, blend, first, n = setup
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("v_shift", "2-2")):
        shifted = blend(CB)
    selected = torch.tensor(shifted.stats.selected_positions, dtype=torch.long)
    for start in range(first, first + n, 24):  # each chunk's stale values: the error's mean is gone
        chunk = torch.arange(start, start + 24)
        stale = chunk[~torch.isin(chunk, selected)]
        error = shifted.cache.layers[2].values[0][:, stale] - reference[2][1][:, stale]
        torch.testing.assert_close(error.mean(dim=1), torch.zeros_like(error[:, 0]), atol=1e-5, rtol=0)
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("v_shift", "2-2", 8)):
        windowed = blend(CB)
    for start in range(first, first + n, 8):  # one shift per window of 8 tokens: each window's mean is gone
        window = torch.arange(start, start + 8)
        stale = window[~torch.isin(window, selected)]
        if stale.numel():
            error = windowed.cache.layers[2].values[0][:, stale] - reference[2][1][:, stale]
            torch.testing.assert_close(error.mean(dim=1), torch.zeros_like(error[:, 0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="oracle_window"):
        oracle.OracleSetting("v_shift", window=-1)


def test_the_local_key_correction_at_infinite_width_is_the_chunk_mean(oracle, setup):
    _, _, _, blend, _, _ = setup
    config = BlendConfig(selection="kv_deviation", recompute_ratio=0.2, stale_key_correction=0.5)
    mean = blend(config)
    with oracle.local_key_correction(1e9):
        wide = blend(config)
    with oracle.local_key_correction(2.0):
        local = blend(config)
    for a, b, _c in zip(mean.cache.layers, wide.cache.layers, local.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
    assert any(not torch.allclose(a.keys, c.keys, atol=1e-4) for a, c in zip(mean.cache.layers, local.cache.layers))


PROBED = BlendConfig(selection="kv_deviation", recompute_ratio=0.3, shift_probe_stride=6, stale_key_correction=1.0,
                     stale_value_correction=1.0)


def test_probes_placed_half_a_stride_in_are_the_engines(oracle, setup):
    _, _, _, blend, _, _ = setup
    engine_placed = blend(PROBED)
    with oracle.probes_offset(3):
        same = blend(PROBED)
    with oracle.probes_offset(1):
        moved = blend(PROBED)
    torch.testing.assert_close(same.logits, engine_placed.logits, atol=0, rtol=0)
    assert set(moved.stats.selected_positions) != set(engine_placed.stats.selected_positions)


def test_robust_shift_estimates(oracle, setup):
    _, _, _, blend, _, _ = setup
    mean = blend(PROBED)
    results = {}
    for mode in oracle.SHIFT_ESTIMATES:
        with oracle.robust_shift_estimate(mode):
            results[mode] = blend(PROBED)
        assert results[mode].stats.selected_positions == mean.stats.selected_positions  # the same tokens
        assert torch.isfinite(results[mode].logits).all()
    # No probe is over twice its chunk's median change here, so clipping drops none: the plain mean.
    torch.testing.assert_close(results["clip"].logits, mean.logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(results["median"].logits, mean.logits, atol=1e-4)
    with pytest.raises(ValueError, match="shift_estimate='mode': choose one of median, clip"):
        oracle.robust_shift_estimate("mode")


def test_split_half_reliability_keeps_a_shift_the_probes_agree_on_and_drops_one_they_do_not(oracle):
    from types import SimpleNamespace

    from cacheblend_rag.engine.blend_run import BlendRun

    # Two groups of four probes, one token each after them: group 0's probes all moved the same way,
    # group 1's even and odd probes moved opposite ways.
    run = SimpleNamespace(estimators=torch.arange(8), chunk_of=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), shift_groups=2)
    direction = torch.tensor([1.0, -2.0, 0.5])
    change = torch.stack([direction] * 4 + [direction, -direction, direction, -direction]).view(1, 1, 8, 3)
    change[0, 0, 4:] += 0.1  # group 1's mean is small but not zero
    with oracle.robust_shift_estimate("splithalf"):
        shifts = BlendRun._chunk_means(run, change)
    torch.testing.assert_close(shifts[0, 0, 0], direction)  # agreed: applied whole
    torch.testing.assert_close(shifts[0, 0, 4], torch.zeros(3))  # halves opposed: dropped


def test_the_cap_shortens_only_a_shift_far_longer_than_the_others(oracle):
    from types import SimpleNamespace

    from cacheblend_rag.engine.blend_run import BlendRun

    # Three groups of two probes; group 2's mean shift is ten times the others' length.
    run = SimpleNamespace(estimators=torch.arange(6), chunk_of=torch.tensor([0, 0, 1, 1, 2, 2]), shift_groups=3)
    unit = torch.tensor([0.6, 0.8])
    change = torch.stack([unit, unit, -unit, -unit, 10 * unit, 10 * unit]).view(1, 1, 6, 2)
    with oracle.robust_shift_estimate("cap"):
        shifts = BlendRun._chunk_means(run, change)
    torch.testing.assert_close(shifts[0, 0, 0], unit)
    torch.testing.assert_close(shifts[0, 0, 2], -unit)
    torch.testing.assert_close(shifts[0, 0, 4], 1.5 * unit)  # capped at 1.5 times the median length, 1


def test_the_similarity_kernel_at_zero_sharpness_is_the_probes_mean(oracle, setup):
    _, _, _, blend, _, _ = setup
    mean = blend(PROBED)
    with oracle.similar_shift(0.0):
        flat = blend(PROBED)
    torch.testing.assert_close(flat.logits, mean.logits, atol=1e-5, rtol=1e-5)
    for feature, pool in (("key", "probes"), ("value", "probes"), ("key", "all")):
        with oracle.similar_shift(20.0, feature, pool):
            sharp = blend(PROBED)
        assert sharp.stats.selected_positions == mean.stats.selected_positions
        assert torch.isfinite(sharp.logits).all()
        assert not torch.allclose(sharp.logits, mean.logits, atol=1e-4)
    with pytest.raises(ValueError, match="shift_kernel_on='query'"):
        oracle.similar_shift(1.0, "query")


def test_the_nonsink_pool_estimates_from_every_recomputed_token_but_each_chunks_first(oracle, setup, monkeypatch):
    _, _, _, blend, _, _ = setup
    seen = []
    kernel = oracle.group_kernel

    def recording(run, logits, change):
        starts = {start for start, _ in run.layout.chunk_spans}
        seen.append((set(run.estimators.tolist()), set(run.selected.tolist()) - starts, set(run.probes.tolist())))
        return kernel(run, logits, change)

    monkeypatch.setattr(oracle, "group_kernel", recording)
    with oracle.similar_shift(0.0, "key", "nonsink"):
        result = blend(PROBED)
    assert torch.isfinite(result.logits).all() and seen
    estimators, selected_but_starts, probes = seen[-1]
    assert estimators == selected_but_starts and probes < estimators  # the probes and the selector's picks
    with pytest.raises(ValueError, match="shift_kernel_pool='some'"):
        oracle.similar_shift(1.0, "key", "some")


def test_residual_deviation_ignores_a_change_shared_by_a_whole_chunk(oracle):
    from cacheblend_rag.engine.selection import SelectionContext

    cached = torch.zeros(2, 6, 4)
    fresh = cached.clone()
    fresh[:, :3] += 5.0  # the first chunk moves as one: nothing left once its mean is taken out
    fresh[:, 4] += 1.0  # one token of the second chunk moves alone
    ctx = SelectionContext(layer=1, budget=1, fresh_k=fresh, fresh_v=fresh, cached_k=cached, cached_v=cached,
                           chunk_spans=[(0, 3), (3, 6)])
    assert int(ctx.deviation_scores().argmax()) < 3
    with oracle.residual_deviation():
        residual = ctx.deviation_scores()
    assert int(residual.argmax()) == 4 and torch.allclose(residual[:3], torch.zeros(3))


def test_a_pooled_slope_changes_the_blend_but_not_its_selection(oracle, setup):
    _, _, _, blend, _, _ = setup
    mean = blend(PROBED)
    for kind, feature, pool in (("channel", "own", "probes"), ("head", "own", "probes"),
                                ("channel", "deviation", "all"), ("channel", "logdeviation", "probes"),
                                ("channel", "position", "probes"), ("head", "logposition", "probes")):
        with oracle.sloped_shift(kind, feature, pool):
            sloped = blend(PROBED)
        assert sloped.stats.selected_positions == mean.stats.selected_positions
        assert torch.isfinite(sloped.logits).all()
        assert not torch.allclose(sloped.logits, mean.logits, atol=1e-4)
    with pytest.raises(ValueError, match="shift_slope='token'"):
        oracle.sloped_shift("token")
    with pytest.raises(ValueError, match="shift_slope_pool='some'"):
        oracle.sloped_shift("channel", "own", "some")


def assert_the_mean_then_moved(blend, config, as_mean, moved):
    """Blended under the patch ``as_mean`` the result is the probes' plain mean; under ``moved`` the same tokens are
    chosen and the blend moves off it."""
    mean = blend(config)
    with as_mean:
        flat = blend(config)
    torch.testing.assert_close(flat.logits, mean.logits, atol=1e-5, rtol=1e-5)
    with moved:
        local = blend(config)
    assert local.stats.selected_positions == mean.stats.selected_positions
    assert torch.isfinite(local.logits).all()
    assert not torch.allclose(local.logits, mean.logits, atol=1e-4)


def test_a_long_positional_kernel_is_the_probes_mean_and_a_short_one_is_not(oracle, setup):
    _, _, _, blend, _, _ = setup
    assert_the_mean_then_moved(blend, PROBED, oracle.positional_shift(1e9), oracle.positional_shift(1.0))
    with pytest.raises(ValueError, match="shift_poskernel=0"):
        oracle.positional_shift(0)


def test_a_profile_over_the_full_reuse_cache_ranks_as_the_plain_profile(oracle, setup):
    _, full, _, blend, _, _ = setup
    profiled = BlendConfig(selection="query_profiled", recompute_ratio=0.25)
    plain = blend(profiled)
    with oracle.corrected_profile(lambda: blend(profiled.with_overrides(recompute_ratio=0.0)).cache):
        same = blend(profiled)
    assert same.stats.selected_positions == plain.stats.selected_positions
    torch.testing.assert_close(same.logits, plain.logits, atol=1e-5, rtol=1e-5)
    # Ranked over the exact cache, the blend still builds on the stale chunks: it is no full prefill.
    with oracle.corrected_profile(lambda: blend(profiled.with_overrides(recompute_ratio=1.0)).cache):
        ranked = blend(profiled)
    assert len(ranked.stats.selected_positions) == len(plain.stats.selected_positions)
    assert not torch.allclose(ranked.logits, full.logits, atol=1e-4)
    with pytest.raises(ValueError, match="profile_rank='most'"):
        oracle.corrected_profile(lambda: None, "most")


def test_lead_tokens_put_each_chunks_first_tokens_in_the_profiles_choice(oracle, setup):
    _, _, _, blend, n_lead, _ = setup
    profiled = BlendConfig(selection="query_profiled", recompute_ratio=0.25)
    plain = set(blend(profiled).stats.selected_positions)
    with oracle.chunk_lead_tokens(3):
        led = blend(profiled).stats.selected_positions
    leads = {n_lead + 24 * c + i for c in range(3) for i in range(3)}  # the fixture's three 24-token chunks
    assert leads <= set(led) and len(led) == len(plain)
    assert set(led) - leads <= plain  # the rest of the budget: the profile's own ranking


def test_an_offset_profile_one_bucket_wide_is_the_probes_mean_and_a_narrow_one_is_not(oracle, setup):
    _, _, _, blend, _, _ = setup
    # One bucket: the departures from each chunk's mean sum to zero.
    assert_the_mean_then_moved(blend, PROBED, oracle.pooled_offset_shift(10**6), oracle.pooled_offset_shift(6))
    with pytest.raises(ValueError, match="shift_offset_profile=0"):
        oracle.pooled_offset_shift(0)


def test_the_shape_oracle_leaves_each_offset_buckets_error_with_zero_mean_over_the_chunks(oracle, setup):
    _, _, reference, blend, first, n = setup
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("kv_shape", "2-2", 8)):
        shaped = blend(CB)
    selected = torch.tensor(shaped.stats.selected_positions, dtype=torch.long)
    positions = torch.arange(first, first + n)
    stale = positions[~torch.isin(positions, selected)]
    bucket = ((stale - first) % 24) // 8  # three chunks of 24 tokens
    error = shaped.cache.layers[2].values[0][:, stale] - reference[2][1][:, stale]
    for b in bucket.unique():
        torch.testing.assert_close(error[:, bucket == b].mean(dim=1), torch.zeros_like(error[:, 0]), atol=1e-5, rtol=0)
    chunk = (stale - first) // 24
    per_chunk = torch.stack([error[:, chunk == c].mean(dim=1) for c in chunk.unique()])
    assert per_chunk.abs().max() > 1e-4  # the chunks' own means are not zero: the shape is shared, not theirs


def test_a_local_shift_keeps_the_selection_and_moves_the_blend_off_the_probes_mean(oracle, setup):
    _, _, _, blend, _, _ = setup
    mean = blend(PROBED)
    for mode in ("nearest", "adaptive"):
        with oracle.local_shift(mode):
            local = blend(PROBED)
        assert local.stats.selected_positions == mean.stats.selected_positions
        assert torch.isfinite(local.logits).all()
    with oracle.local_shift("nearest"):
        nearest = blend(PROBED)
    assert not torch.allclose(nearest.logits, mean.logits, atol=1e-4)
    with pytest.raises(ValueError, match="shift_local='far'"):
        oracle.local_shift("far")


def test_the_adaptive_local_weight_follows_how_much_neighbouring_probes_agree(oracle):
    run = SimpleNamespace(layout=SimpleNamespace(n_cached=8), chunk_of=torch.zeros(8, dtype=torch.long),
                          estimators=torch.tensor([1, 3, 5, 7]))
    run._chunk_means = lambda change: change.mean(dim=2, keepdim=True).expand(-1, -1, 8, -1)
    captured = {}

    def capture(shift_of, pool):
        captured["shift_of"] = shift_of
        return contextlib.nullcontext()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(oracle, "stale_correction", capture)
        oracle.local_shift("adaptive")
    shift_of = captured["shift_of"]
    smooth = torch.tensor([1.0, 1.0, -1.0, -1.0]).view(1, 1, 4, 1)  # neighbours agree: the drift is kept
    alternating = torch.tensor([1.0, -1.0, 1.0, -1.0]).view(1, 1, 4, 1)  # they disagree: nothing is kept
    kept = shift_of(run, "value", None, None, smooth)[0, 0, :, 0]
    assert kept[0] > 0 and kept[7] < 0 and kept.abs().max() < 1.0  # a share of the departure, not all of it
    dropped = shift_of(run, "value", None, None, alternating)[0, 0, :, 0]
    torch.testing.assert_close(dropped, torch.zeros(8))


def test_a_conditioned_shape_is_nothing_when_the_prefix_changes_nothing_and_moves_the_blend_when_it_does(
        oracle, three_chunk_prompt):
    engine, _, chunks, _, blend = three_chunk_prompt
    plain = [engine.prefill_chunk(c) for c in chunks]
    behind = [engine.prefill_chunk(c, prefix_ids=[11, 12, 13, 14, 15]) for c in chunks]
    assert_the_mean_then_moved(blend, PROBED.with_overrides(shift_window=12), oracle.conditioned_shape(plain, plain, 6),
                               oracle.conditioned_shape(plain, behind, 6))
    with pytest.raises(ValueError, match="shift_shape=0"):
        oracle.conditioned_shape(plain, plain, 0)


def test_an_oracle_shift_sampled_at_every_token_is_the_whole_windows_and_a_sparser_one_is_not(oracle, setup):
    _, _, reference, blend, _, _ = setup
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("kv_shift", None, 8)):
        whole = blend(CB)
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("kv_shift", None, 8, 1)):
        every = blend(CB)
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("kv_shift", None, 8, 4)):
        sparse = blend(CB)
    torch.testing.assert_close(every.logits, whole.logits, atol=0, rtol=0)
    assert sparse.stats.selected_positions == whole.stats.selected_positions
    assert not torch.allclose(sparse.logits, whole.logits, atol=1e-4)
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("kv_shift", None, 8, "4/3")):
        default_phase = blend(CB)  # one past half of 4: offset 3
    with oracle.oracle_blend(reference, oracle.OracleSetting.parse("kv_shift", None, 8, "4/0")):
        other_phase = blend(CB)
    torch.testing.assert_close(default_phase.logits, sparse.logits, atol=0, rtol=0)
    assert not torch.allclose(other_phase.logits, sparse.logits, atol=1e-4)
    with pytest.raises(ValueError, match="oracle_sample"):
        oracle.OracleSetting("k_full", sample=2)
    with pytest.raises(ValueError, match="phase"):
        oracle.OracleSetting.parse("kv_shift", None, 8, "4/4")


def test_the_probes_exact_errors_move_each_group_by_their_mean(oracle):
    # Four cached tokens at prompt positions 2-5 in one group, probes at the first and third; RoPE at angle zero.
    run = SimpleNamespace(keys=[None], layout=SimpleNamespace(cached_pos=torch.arange(2, 6)),
                          estimators=torch.tensor([0, 2]), cos=torch.ones(1, 6, 2), sin=torch.zeros(1, 6, 2),
                          a=SimpleNamespace(apply_rope=lambda x, cos, sin: x * cos + 0 * sin))
    run._chunk_means = lambda change: change.mean(dim=2, keepdim=True).expand(-1, -1, 4, -1)
    captured = {}

    def capture(shift_of, pool):
        captured["shift_of"] = shift_of
        return contextlib.nullcontext()

    stale = torch.zeros(1, 1, 4, 2)
    ref = torch.zeros(1, 6, 2)
    ref[0, 2], ref[0, 4] = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0])  # the probes' exact errors
    ref[0, 3] = 100.0  # a stale token's own error: not seen
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(oracle, "stale_correction", capture)
        oracle.probe_truth_shift([(torch.zeros(1, 6, 2), torch.zeros(1, 6, 2)), (ref, ref)])
    for kind in ("key", "value"):
        shift = captured["shift_of"](run, kind, stale, stale, None)
        torch.testing.assert_close(shift[0, 0], torch.tensor([[2.0, 1.0]] * 4))


def test_the_probes_exact_errors_keep_the_selection_and_move_the_blend(oracle, setup):
    _, _, reference, blend, _, _ = setup
    mean = blend(PROBED)
    with oracle.probe_truth_shift(reference):
        exact = blend(PROBED)
    assert exact.stats.selected_positions == mean.stats.selected_positions
    assert torch.isfinite(exact.logits).all()
    assert not torch.allclose(exact.logits, mean.logits, atol=1e-4)
