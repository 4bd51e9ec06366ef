"""The research loop's tail recompute (research/fidelity_tail.py, research/quality_notebook.md "The last layers
for every token"): recomputing every layer for every token is full prefill, the layers before the tail are the plain
blend's, and in the tail no cached entry is stale."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig


@pytest.fixture(scope="module")
def tail(research_module):
    with research_module("fidelity_tail") as module:
        yield module


CB = BlendConfig(selection="kv_deviation", recompute_ratio=0.2)


def test_every_layer_as_the_tail_is_full_prefill(tail, three_chunk_prompt):
    engine, _, chunks, full, blend = three_chunk_prompt
    embeddings = tail.chunk_hidden_states(engine.adapter, chunks, (), 0)
    torch.testing.assert_close(embeddings, engine.adapter.embed(torch.tensor([sum(chunks, [])]))[0])
    reuse = BlendConfig(recompute_ratio=0.0)
    assert not torch.allclose(blend(reuse).logits, full.logits, atol=1e-3)
    with tail.tail_blend(embeddings, 0):
        widened = blend(reuse)
    torch.testing.assert_close(widened.logits, full.logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("drift", ["none", "selected"])
def test_the_tail_recomputes_every_cached_entry_and_nothing_before_it(tail, three_chunk_prompt, drift):
    engine, lead, chunks, _, blend = three_chunk_prompt
    first = len(lead)
    start = engine.num_layers - 2
    stored = tail.chunk_hidden_states(engine.adapter, chunks, (), start)
    plain = blend(CB)
    with tail.tail_blend(stored, start, drift):
        widened = blend(CB)
    stale = [p for p in range(first, first + 72) if p not in set(plain.stats.selected_positions)]
    for layer in range(engine.num_layers):
        got, was = widened.cache.layers[layer], plain.cache.layers[layer]
        if layer < start or (layer == start and drift == "none"):
            # the tail's first layer reads the stored hidden states, which are what its stored K/V came from
            torch.testing.assert_close(got.values[0][:, stale], was.values[0][:, stale])
        else:  # computed again: from the drifted hidden states, or after a layer over the whole prompt
            assert not torch.allclose(got.values[0][:, stale], was.values[0][:, stale], atol=1e-5)
    with pytest.raises(ValueError, match="tail_drift="):
        tail.tail_blend(stored, start, "all")
