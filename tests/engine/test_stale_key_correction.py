"""``BlendConfig.stale_key_correction``: at 0 the blend is the one without it, bit for bit; otherwise a stale
chunk token keeps its stored value, and its key (before RoPE) is the stored one plus the share of the mean
change its chunk's recomputed keys saw in that layer, with both selectors (the deviation check layer and
the profile chosen before layer 0)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.config import BlendConfig

TEXTS = ["Marie Curie was a physicist and chemist who won two Nobel prizes.",
         "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
         "The Eiffel Tower was completed in 1889 for the World's Fair in Paris."]


@pytest.fixture(scope="module")
def blend_inputs(passages_prompt):
    engine, segments = passages_prompt
    return engine, segments(TEXTS)


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
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_stale_keys_move_by_the_share_of_their_chunks_mean_change(blend_inputs, selection, share):
    """In every layer where a chunk's tokens are chosen, its other keys (before RoPE) are the stored ones plus
    ``share`` times the mean of (fresh - stored) over the chosen ones; stale values stay as stored."""
    engine, segments = blend_inputs
    config = BlendConfig(recompute_ratio=0.3, selection=selection, gate=False)
    plain = engine.blend(segments, config=config)
    shifted = engine.blend(segments, config=config.with_overrides(stale_key_correction=share))
    assert plain.stats.selected_positions == shifted.stats.selected_positions
    n = len(plain.input_ids)
    adapter = engine.adapter
    cos, sin = adapter.rope_cos_sin(torch.zeros(1, 1, adapter.head_dim), torch.arange(n).unsqueeze(0))
    chosen = set(plain.stats.selected_positions)
    checked = 0
    for layer in range(engine.num_layers):
        before, after = plain.cache.layers[layer], shifted.cache.layers[layer]
        unrotated = adapter.apply_rope(after.keys, cos, -sin)[0]  # [kv_heads, n, head_dim], before RoPE
        start = len(segments[0].token_ids)
        for segment in segments[1:-1]:
            stored_k, stored_v = segment.chunk.keys[layer], segment.chunk.values[layer]
            positions = range(start, start + len(segment.token_ids))
            picked = [i for i, p in enumerate(positions) if p in chosen]
            stale = [i for i, p in enumerate(positions) if p not in chosen]
            start += len(segment.token_ids)
            rotated_stored = adapter.apply_rope(stored_k.unsqueeze(0), cos[:, positions], sin[:, positions])[0]
            if not picked or not torch.allclose(before.keys[0][:, positions][:, stale], rotated_stored[:, stale],
                                                atol=1e-5):
                continue  # a layer every token ran (before the check layer): nothing is stale there
            own = unrotated[:, positions]
            mean_change = (own[:, picked] - stored_k[:, picked]).mean(dim=1, keepdim=True)
            torch.testing.assert_close(own[:, stale] - stored_k[:, stale], share * mean_change.expand(-1, len(stale), -1),
                                       rtol=1e-4, atol=1e-5)
            assert torch.equal(after.values[0][:, positions][:, stale], stored_v[:, stale])
            checked += 1
    assert checked >= engine.num_layers - 2  # every chunk of the layers after the check layer


@pytest.mark.parametrize("value", [-0.1, 2.5, float("nan")])
def test_an_out_of_range_value_is_refused_by_name(value):
    from cacheblend_rag.errors import ConfigError

    with pytest.raises(ConfigError, match="stale_key_correction"):
        BlendConfig(stale_key_correction=value)
