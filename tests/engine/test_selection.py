"""Each selection strategy on synthetic evidence: no model, just the tensors a strategy is shown."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig
from cacheblend_rag.engine.selection import (
    GradualFilter,
    KVDeviation,
    ProfileRequest,
    QueryAware,
    QueryProfiled,
    SelectionContext,
    SelectionStrategy,
    SinkAware,
    available_strategies,
    build_strategy,
    register_strategy,
    selection_budget,
    top_indices,
)
from cacheblend_rag.errors import ConfigError


def context(value_dev, *, key_dev=None, budget, spans=None, attention=None, layers_left=3):
    """Cached K/V of zeros and fresh K/V whose squared deviation per token is ``value_dev``/``key_dev``."""
    n = len(value_dev)
    cached = torch.zeros(2, n, 4)
    fresh_v = torch.zeros(2, n, 4)
    fresh_v[0, :, 0] = torch.tensor(value_dev, dtype=torch.float32).sqrt()
    fresh_k = torch.zeros(2, n, 4)
    if key_dev is not None:
        fresh_k[0, :, 0] = torch.tensor(key_dev, dtype=torch.float32).sqrt()
    ctx = SelectionContext(layer=1, budget=budget, fresh_k=fresh_k, fresh_v=fresh_v, cached_k=cached,
                           cached_v=cached.clone(), chunk_spans=spans or [(0, n)], layers_left=layers_left)
    if attention is not None:
        ctx.query_attention = lambda: torch.tensor(attention, dtype=torch.float32)
    return ctx


def test_budget_rounds_and_never_exceeds_the_cached_tokens():
    assert selection_budget(0.15, 100) == 15
    assert selection_budget(0.155, 100) == 16
    assert selection_budget(1.0, 7) == 7
    assert selection_budget(0.0, 7) == 0


def test_top_indices_are_sorted_and_ties_go_to_the_earlier_token():
    assert top_indices(torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0]), 2).tolist() == [1, 2]
    assert top_indices(torch.tensor([1.0, 2.0]), 0).tolist() == []


def test_kv_deviation_ranks_by_value_or_key_deviation():
    ctx = context([0.1, 5.0, 0.2, 4.0, 0.0], key_dev=[9.0, 0.0, 8.0, 0.0, 0.0], budget=2)
    assert KVDeviation().select(ctx).tolist() == [1, 3]
    assert KVDeviation(deviation="key").select(ctx).tolist() == [0, 2]


def test_sink_aware_always_takes_each_chunks_first_tokens():
    ctx = context([0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 7.0], budget=4, spans=[(0, 3), (3, 7)])
    assert SinkAware(sink_tokens=1).select(ctx).tolist() == [0, 2, 3, 5]
    # Sinks beyond the budget are cut, in chunk order.
    assert SinkAware(sink_tokens=3).select(context([0.0] * 7, budget=2, spans=[(0, 3), (3, 7)])).tolist() == [0, 1]


def test_query_aware_mixes_attention_and_deviation():
    ctx = context([0.0, 10.0, 0.0, 0.0], budget=1, attention=[0.0, 0.0, 0.0, 5.0])
    assert QueryAware(query_weight=1.0).select(ctx).tolist() == [3]
    assert QueryAware(query_weight=0.0).select(ctx).tolist() == [1]
    assert QueryAware().needs.query_attention and QueryAware().needs.profile is None


def test_a_strategy_without_the_evidence_it_needs_says_so():
    with pytest.raises(RuntimeError, match="declare it in the strategy's `needs`"):
        QueryAware().select(context([1.0, 2.0], budget=1))


def test_gradual_starts_wide_and_halves_down_to_the_budget():
    strategy = GradualFilter(expand=2.0)
    ctx = context([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], budget=2, layers_left=3)
    wide = strategy.select(ctx)
    assert wide.tolist() == [4, 5, 6, 7]
    narrower = strategy.refine(context([5.0, 9.0, 1.0, 8.0], budget=2, layers_left=2), wide)
    assert narrower.tolist() == [5, 7]
    assert strategy.refine(context([1.0, 2.0], budget=2), narrower) is None
    # At the last layer the budget is reached at once.
    assert strategy.select(context([1.0, 2.0, 3.0, 4.0], budget=1, layers_left=0)).tolist() == [3]


def test_query_profiled_takes_the_most_attended_tokens_and_asks_for_a_profile():
    strategy = QueryProfiled(profile_layers=3, profile_tokens=8)
    assert strategy.needs.profile == ProfileRequest(layers=3, question_tokens=8)
    assert strategy.needs.check_layer == 0
    ctx = context([9.0, 9.0, 0.0, 0.0], budget=2, attention=[0.1, 0.2, 3.0, 2.0])
    assert strategy.select(ctx).tolist() == [2, 3]


def test_strategies_are_built_with_their_own_settings():
    cfg = BlendConfig(deviation="key", sink_tokens=2, query_weight=0.3, gradual_expand=3.0,
                      profile_layers=5, profile_tokens=4)
    built = {name: build_strategy(cfg.with_overrides(selection=name)) for name in available_strategies()}
    assert built["kv_deviation"] == KVDeviation(deviation="key")
    assert built["sink_aware"] == SinkAware(deviation="key", sink_tokens=2)
    assert built["query_aware"] == QueryAware(deviation="key", query_weight=0.3)
    assert built["gradual"] == GradualFilter(deviation="key", expand=3.0)
    assert built["query_profiled"] == QueryProfiled(profile_layers=5, profile_tokens=4)


def test_unknown_strategy_names_what_is_registered():
    with pytest.raises(ConfigError, match=r"selection='nope' is not supported; choose one of 'gradual'"):
        build_strategy(BlendConfig(selection="nope"))


def test_a_registered_strategy_is_used_by_the_engine(monkeypatch):
    from cacheblend_rag.engine import selection
    from cacheblend_rag.testing import tiny_engine

    monkeypatch.setattr(selection, "_REGISTRY", dict(selection._REGISTRY))  # registered for this test only

    class FirstTokens(SelectionStrategy):
        name = "first_tokens_test"

        def select(self, ctx):
            return torch.arange(ctx.budget)

    register_strategy(FirstTokens)
    engine = tiny_engine("llama")
    ids = engine.tokenize("Paris is the capital of France. The quick brown fox jumps.")
    chunk = engine.prefill_chunk(ids)
    lead = engine.tokenize("Context:")
    result = engine.blend([lead, chunk, engine.tokenize("Question?")],
                          config=BlendConfig(recompute_ratio=0.25, selection="first_tokens_test"))
    budget = selection_budget(0.25, len(ids))
    assert result.stats.selected_positions == list(range(len(lead), len(lead) + budget))
