"""``BlendConfig.shift_probe_stride`` and ``stale_value_correction``: probe tokens are recomputed inside the
budget and the strategy picks the rest among the others; the stale K/V of a chunk move by the shares of the
mean change its *probes* saw (keys before RoPE), not its other recomputed tokens'; and a blend that
recomputes everything is still full prefill."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.selection import probe_indices
from cacheblend_rag.errors import ConfigError

TEXTS = ["Marie Curie was a physicist and chemist who won two Nobel prizes for her research on radioactivity.",
         "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean near the equator.",
         "The Eiffel Tower was completed in 1889 for the World's Fair in Paris and was the tallest building."]
PROBED = dict(shift_probe_stride=4, stale_key_correction=1.0, stale_value_correction=1.0)


def chunk_spans(segments) -> list[tuple[int, int]]:
    """The chunks' [start, end) among the cached tokens after the lead (every segment but the first and last)."""
    spans, start = [], 0
    for segment in segments[1:-1]:
        spans.append((start, start + len(segment.token_ids)))
        start += len(segment.token_ids)
    return spans


@pytest.fixture(scope="module")
def blend_inputs(passages_prompt):
    engine, segments = passages_prompt
    return engine, segments(TEXTS)


def test_probes_are_evenly_spaced_and_never_a_chunks_first_token():
    assert probe_indices([(0, 10), (10, 25)], 4).tolist() == [2, 6, 12, 16, 20, 24]
    assert probe_indices([(0, 10)], 0).numel() == 0
    assert probe_indices([(0, 3)], 2).tolist() == [1]


@pytest.mark.parametrize("selection", ["kv_deviation", "query_profiled"])
def test_the_probes_are_recomputed_and_the_strategy_picks_the_rest(blend_inputs, selection):
    engine, segments = blend_inputs
    config = BlendConfig(recompute_ratio=0.4, selection=selection, gate=False)
    plain = engine.blend(segments, config=config)
    probed = engine.blend(segments, config=config.with_overrides(**PROBED))
    first, spans = len(segments[0].token_ids), chunk_spans(segments)
    probes = {first + i for i in probe_indices(spans, 4).tolist()}
    chosen = set(probed.stats.selected_positions)
    assert probes <= chosen
    assert len(chosen) == len(plain.stats.selected_positions)  # the same budget, probes inside it


@pytest.mark.parametrize("selection", ["kv_deviation", "query_profiled"])
@pytest.mark.parametrize("shares", [(1.0, 1.0), (0.0, 0.5), (0.5, 0.0)])
def test_stale_entries_move_by_their_chunks_probes_mean_change(blend_inputs, selection, shares):
    engine, segments = blend_inputs
    key_share, value_share = shares
    config = BlendConfig(recompute_ratio=0.4, selection=selection, gate=False, shift_probe_stride=4,
                         stale_key_correction=key_share, stale_value_correction=value_share)
    result = engine.blend(segments, config=config)
    n = len(result.input_ids)
    adapter = engine.adapter
    cos, sin = adapter.rope_cos_sin(torch.zeros(1, 1, adapter.head_dim), torch.arange(n).unsqueeze(0))
    chosen = set(result.stats.selected_positions)
    checked = 0
    for layer in range(2, engine.num_layers):  # both selectors patch every layer after the check layer (1)
        cache = result.cache.layers[layer]
        keys = adapter.apply_rope(cache.keys, cos, -sin)[0]  # [kv_heads, n, head_dim], before RoPE
        values = cache.values[0]
        start = len(segments[0].token_ids)
        for segment in segments[1:-1]:
            stored_k, stored_v = segment.chunk.keys[layer], segment.chunk.values[layer]
            positions = list(range(start, start + len(segment.token_ids)))
            probes = probe_indices([(0, len(positions))], 4).tolist()
            stale = [i for i, p in enumerate(positions) if p not in chosen]
            start += len(segment.token_ids)
            own_k, own_v = keys[:, positions], values[:, positions]
            key_change = (own_k[:, probes] - stored_k[:, probes]).mean(dim=1, keepdim=True)
            value_change = (own_v[:, probes] - stored_v[:, probes]).mean(dim=1, keepdim=True)
            torch.testing.assert_close(own_k[:, stale] - stored_k[:, stale],
                                       key_share * key_change.expand(-1, len(stale), -1), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(own_v[:, stale] - stored_v[:, stale],
                                       value_share * value_change.expand(-1, len(stale), -1), rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked == 3 * (engine.num_layers - 2)


def test_without_probes_or_shares_the_blend_is_as_it_was(blend_inputs):
    engine, segments = blend_inputs
    config = BlendConfig(recompute_ratio=0.4, selection="kv_deviation", gate=False)
    plain = engine.blend(segments, config=config)
    same = engine.blend(segments, config=config.with_overrides(stale_value_correction=0.0, shift_probe_stride=0))
    assert torch.equal(plain.logits, same.logits)


def test_recomputing_everything_with_probes_is_full_prefill(blend_inputs):
    engine, segments = blend_inputs
    full = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, gate=False))
    probed = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, gate=False, **PROBED))
    torch.testing.assert_close(probed.logits, full.logits)


@pytest.mark.parametrize("fields, message", [
    (dict(stale_value_correction=-0.1), "stale_value_correction"),
    (dict(stale_value_correction=float("nan")), "stale_value_correction"),
    (dict(shift_probe_stride=-1), "shift_probe_stride"),
    (dict(shift_probe_stride=2.5, stale_key_correction=1.0), "shift_probe_stride"),
    (dict(shift_probe_stride=1, stale_key_correction=1.0), "stride of 2 or more"),
    (dict(shift_probe_stride=20), "set stale_key_correction and/or stale_value_correction"),
    (dict(shift_window=-3), "shift_window"),
])
def test_bad_values_are_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        BlendConfig(**fields)


def test_a_window_as_wide_as_the_chunk_is_the_chunk_and_narrower_windows_shift_apart(blend_inputs):
    engine, segments = blend_inputs
    config = BlendConfig(recompute_ratio=0.4, selection="kv_deviation", gate=False, **PROBED)
    whole = engine.blend(segments, config=config)
    wide = engine.blend(segments, config=config.with_overrides(shift_window=10_000))
    assert torch.equal(whole.logits, wide.logits)
    narrow = engine.blend(segments, config=config.with_overrides(shift_window=8))
    layer, start = 3, len(segments[0].token_ids)
    chosen = set(narrow.stats.selected_positions)
    stored_v = segments[1].chunk.values[layer]
    values = narrow.cache.layers[layer].values[0]
    probes = probe_indices([(0, len(segments[1].token_ids))], 4).tolist()
    checked = 0
    for window_start in range(0, len(segments[1].token_ids), 8):  # each window moves by its own probes' mean
        window = range(window_start, min(window_start + 8, len(segments[1].token_ids)))
        mine = [i for i in probes if i in window]
        stale = [i for i in window if start + i not in chosen]
        if not mine or not stale:
            continue
        change = (values[:, [start + i for i in mine]] - stored_v[:, mine]).mean(dim=1, keepdim=True)
        torch.testing.assert_close(values[:, [start + i for i in stale]] - stored_v[:, stale],
                                   change.expand(-1, len(stale), -1), rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("selection", ["kv_deviation", "query_profiled"])
def test_a_budget_below_the_probes_drops_them_and_the_corrections(blend_inputs, selection):
    engine, segments = blend_inputs
    # Every other token a probe: more probes than a 0.2 budget holds. Too few probes estimate the shifts worse
    # than none (research/quality_notebook.md), so the blend is the strategy's alone, uncorrected.
    probed = BlendConfig(recompute_ratio=0.2, selection=selection, gate=False, shift_probe_stride=2,
                         stale_key_correction=1.0, stale_value_correction=1.0)
    result = engine.blend(segments, config=probed)
    alone = engine.blend(segments, config=probed.with_overrides(shift_probe_stride=0, stale_key_correction=0.0,
                                                                stale_value_correction=0.0))
    assert result.stats.selected_positions == alone.stats.selected_positions
    torch.testing.assert_close(result.logits, alone.logits, atol=0, rtol=0)
    assert result.stats.probes_dropped and result.stats.to_dict()["probes_dropped"]
    assert not alone.stats.probes_dropped
    held = engine.blend(segments, config=probed.with_overrides(shift_probe_stride=10))
    assert not held.stats.probes_dropped  # a budget that holds the probes keeps them
