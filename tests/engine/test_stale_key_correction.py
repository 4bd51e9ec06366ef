"""``BlendConfig.stale_key_correction``: at 0 the blend is what it was, bit for bit; otherwise a stale chunk
token keeps its cached value and its key moves by the same pre-RoPE vector as every other stale token of
its chunk, with both selectors (the deviation check layer and the profile chosen before layer 0)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.segments import CachedSegment, FreshSegment
from cacheblend_rag.testing import tiny_engine

TEXTS = ["Marie Curie was a physicist and chemist who won two Nobel prizes.",
         "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
         "The Eiffel Tower was completed in 1889 for the World's Fair in Paris."]


@pytest.fixture(scope="module")
def blend_inputs():
    engine = tiny_engine("qwen2")
    chunks = engine.prefill_chunks([engine.tokenize(t) for t in TEXTS])
    segments = [FreshSegment(engine.tokenize("Passages:\n")), *map(CachedSegment, chunks),
                FreshSegment(engine.tokenize("Question: who won two Nobel prizes?"))]
    return engine, segments


@pytest.mark.parametrize("selection", ["kv_deviation", "query_profiled"])
def test_alpha_zero_is_the_blend_as_it_was(blend_inputs, selection):
    engine, segments = blend_inputs
    config = BlendConfig(recompute_ratio=0.3, selection=selection, gate=False)
    plain = engine.blend(segments, config=config)
    shifted = engine.blend(segments, config=config.with_overrides(stale_key_correction=0.0))
    assert torch.equal(plain.logits, shifted.logits)
    for layer in range(engine.num_layers):
        assert torch.equal(plain.cache.layers[layer].keys, shifted.cache.layers[layer].keys)


@pytest.mark.parametrize("selection", ["kv_deviation", "query_profiled"])
def test_only_stale_keys_move_and_by_one_pre_rope_vector_per_chunk(blend_inputs, selection):
    engine, segments = blend_inputs
    config = BlendConfig(recompute_ratio=0.3, selection=selection, gate=False)
    plain = engine.blend(segments, config=config)
    shifted = engine.blend(segments, config=config.with_overrides(stale_key_correction=1.0))
    assert plain.stats.selected_positions == shifted.stats.selected_positions
    n = len(plain.input_ids)
    lead = len(segments[0].token_ids)
    spans, start = [], lead
    for segment in segments[1:-1]:
        spans.append(range(start, start + len(segment.token_ids)))
        start += len(segment.token_ids)
    stale = torch.zeros(n, dtype=torch.bool)
    stale[lead:start] = True
    stale[list(plain.stats.selected_positions)] = False
    adapter = engine.adapter
    cos, sin = adapter.rope_cos_sin(torch.zeros(1, 1, adapter.head_dim), torch.arange(n).unsqueeze(0))
    moved_any = False
    for layer in range(engine.num_layers):
        before, after = plain.cache.layers[layer], shifted.cache.layers[layer]
        # A stale token's value is the cache's; the recomputed and fresh tokens' K/V change as they should,
        # through attention over the moved keys of the layers before.
        assert torch.equal(after.values[:, :, stale], before.values[:, :, stale])
        change = adapter.apply_rope(after.keys - before.keys, cos, -sin)  # back before RoPE
        for span in spans:
            rows = [p for p in span if stale[p]]
            if len(rows) > 1:
                torch.testing.assert_close(change[:, :, rows], change[:, :, rows[:1]].expand_as(change[:, :, rows]),
                                           rtol=1e-4, atol=1e-5)
                moved_any |= bool(change[:, :, rows].abs().max() > 1e-6)
    assert moved_any


@pytest.mark.parametrize("value", [-0.1, 2.5, float("nan")])
def test_an_out_of_range_value_is_refused_by_name(value):
    from cacheblend_rag.errors import ConfigError

    with pytest.raises(ConfigError, match="stale_key_correction"):
        BlendConfig(stale_key_correction=value)
