"""Blend correctness on tiny random models of every supported architecture."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig, CachedSegment, FreshSegment
from cacheblend_rag.engine.selection import available_strategies, selection_budget
from cacheblend_rag.testing import tiny_engine

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

PREFIX = "Context information is below.\n"
CHUNKS = [
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
]
QUESTION = "\nQuestion: What is the capital of France? Answer:"


def make_engine(arch: str, **overrides):
    if arch == "llama3-rope":
        return tiny_engine("llama", rope_parameters=LLAMA3_ROPE)
    return tiny_engine(arch, **overrides)


def build_prompt(engine):
    prefix = engine.tokenize(PREFIX)
    chunk_ids = [engine.tokenize(c) for c in CHUNKS]
    question = engine.tokenize(QUESTION)
    chunks = engine.prefill_chunks(chunk_ids)
    segments = [FreshSegment(prefix), *[CachedSegment(c) for c in chunks], FreshSegment(question)]
    full_ids = prefix + [t for c in chunk_ids for t in c] + question
    return segments, full_ids, chunks


@pytest.mark.parametrize("arch", ARCHS + ["llama3-rope"])
@pytest.mark.parametrize("check_layer", [0, 1, 2])
def test_ratio_one_equals_full_prefill(arch, check_layer):
    engine = make_engine(arch)
    segments, full_ids, _ = build_prompt(engine)
    blended = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, check_layer=check_layer))
    full = engine.full_prefill(full_ids)
    assert blended.input_ids == full_ids
    torch.testing.assert_close(blended.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert blended.stats.recomputed_tokens == blended.stats.cached_tokens
    # The decoding cache must hold the same K/V as the model's own prefill.
    for layer in range(engine.num_layers):
        torch.testing.assert_close(blended.cache.layers[layer].keys, full.cache.layers[layer].keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(blended.cache.layers[layer].values, full.cache.layers[layer].values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS + ["llama3-rope"])
def test_generation_at_ratio_one_matches_model_generate(arch):
    engine = make_engine(arch)
    segments, full_ids, _ = build_prompt(engine)
    out = engine.generate(segments, config=BlendConfig(recompute_ratio=1.0), max_new_tokens=12)
    reference = engine.model.generate(torch.tensor([full_ids]), max_new_tokens=12, do_sample=False)
    expected = reference[0, len(full_ids):].tolist()
    eos = engine.tokenizer.eos_token_id
    if eos in expected:
        expected = expected[: expected.index(eos)]
    assert out.token_ids == expected
    assert out.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert out.ttft_s > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_ratio_zero_equals_plain_concatenation(arch):
    """Full reuse: cached K rotated to new positions + V as stored, fresh tokens computed over them."""
    engine = make_engine(arch)
    segments, full_ids, chunks = build_prompt(engine)
    blended = engine.blend(segments, config=BlendConfig(recompute_ratio=0.0))
    assert blended.stats.mode == "full_reuse" and blended.stats.recomputed_tokens == 0

    # Independent computation with the model's own forward: run the prefix fresh, then insert
    # the rotated chunk caches, then run the question against that cache.
    from transformers import DynamicCache

    model, a = engine.model, engine.adapter
    prefix_len = len(segments[0].token_ids)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([full_ids[:prefix_len]]), cache=cache, use_cache=True)
        pos = prefix_len
        for chunk in chunks:
            n = len(chunk)
            positions = torch.arange(pos, pos + n).unsqueeze(0)
            cos, sin = a.rope_cos_sin(torch.zeros(1, dtype=torch.float32), positions)
            for layer in range(a.num_layers):
                k = a.apply_rope(chunk.keys[layer].unsqueeze(0), cos, sin)
                cache.update(k, chunk.values[layer].unsqueeze(0), layer)
            pos += n
        question = segments[-1].token_ids
        out = model(input_ids=torch.tensor([question]), cache=cache, use_cache=True,
                    position_ids=torch.arange(pos, pos + len(question)).unsqueeze(0))
    torch.testing.assert_close(blended.logits, out.logits[0, -1], atol=1e-4, rtol=1e-4)


def test_rerotation_matches_key_computed_at_position():
    engine = make_engine("llama")
    a = engine.adapter
    ids = engine.tokenize(CHUNKS[0])
    chunk = engine.prefill_chunk(ids)
    shift = 37
    # The same tokens computed at positions shift.. with the model's own cache (post-RoPE keys),
    # behind a prefix whose influence is removed by attending only within the chunk: compare
    # layer-0 keys, which depend only on the token itself.
    positions = torch.arange(shift, shift + len(ids)).unsqueeze(0)
    with torch.no_grad():
        hidden = a.embed(torch.tensor([ids]))
        _, k, _ = a.qkv(0, a.input_norm(0, hidden))
        cos, sin = a.rope_cos_sin(hidden, positions)
        expected = a.apply_rope(k, cos, sin)[0]
        rotated = a.apply_rope(chunk.keys[0].unsqueeze(0), cos, sin)[0]
    torch.testing.assert_close(rotated, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("strategy", available_strategies())
def test_selection_picks_budget_plus_uncached(ratio, strategy):
    engine = make_engine("llama")
    segments, full_ids, chunks = build_prompt(engine)
    cfg = BlendConfig(recompute_ratio=ratio, selection=strategy)
    blended = engine.blend(segments, config=cfg)
    n_cached = sum(len(c) for c in chunks)
    assert blended.stats.recomputed_tokens == round(ratio * n_cached) == selection_budget(ratio, n_cached)
    assert blended.stats.fresh_tokens == len(full_ids) - n_cached
    assert len(set(blended.stats.selected_positions)) == blended.stats.recomputed_tokens
    # Every selected position lies inside a cached chunk.
    prefix_len = len(segments[0].token_ids)
    assert all(prefix_len <= p < prefix_len + n_cached for p in blended.stats.selected_positions)


@pytest.mark.parametrize("strategy", available_strategies())
def test_selection_is_deterministic_and_exact_at_one(strategy):
    engine = make_engine("qwen2")
    segments, full_ids, _ = build_prompt(engine)
    cfg = BlendConfig(recompute_ratio=0.3, selection=strategy)
    first = engine.blend(segments, config=cfg)
    second = engine.blend(segments, config=cfg)
    assert first.stats.selected_positions == second.stats.selected_positions
    assert torch.equal(first.logits, second.logits)
    exact = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, selection=strategy))
    torch.testing.assert_close(exact.logits, engine.full_prefill(full_ids).logits, atol=1e-4, rtol=1e-4)
    # With every cached token recomputed there is nothing to choose: no profiling pass runs.
    assert exact.stats.timings["profile"] == 0.0
    assert exact.stats.recomputed_tokens == exact.stats.cached_tokens - exact.stats.exact_tokens


def test_sink_aware_includes_each_chunk_start():
    engine = make_engine("llama")
    segments, _, chunks = build_prompt(engine)
    blended = engine.blend(segments, config=BlendConfig(recompute_ratio=0.3, selection="sink_aware", sink_tokens=3))
    start = len(segments[0].token_ids)
    selected = set(blended.stats.selected_positions)
    for chunk in chunks:
        assert set(range(start, start + 3)) <= selected
        start += len(chunk)


def test_partial_ratio_lies_between_reuse_and_full():
    engine = make_engine("llama")
    segments, full_ids, _ = build_prompt(engine)
    full = engine.full_prefill(full_ids).logits
    errors = [
        (engine.blend(segments, config=BlendConfig(recompute_ratio=r)).logits - full).abs().max().item()
        for r in (0.0, 0.5, 1.0)
    ]
    assert errors[2] < 1e-4 < errors[0]
    assert errors[1] < errors[0]


def test_bottom_right_mask_is_exact_at_full_ratio_and_differs_below():
    engine = make_engine("llama")
    segments, full_ids, _ = build_prompt(engine)
    full = engine.full_prefill(full_ids).logits
    exact_br = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, mask="bottom_right")).logits
    torch.testing.assert_close(exact_br, full, atol=1e-4, rtol=1e-4)
    part_exact = engine.blend(segments, config=BlendConfig(recompute_ratio=0.3)).logits
    part_br = engine.blend(segments, config=BlendConfig(recompute_ratio=0.3, mask="bottom_right")).logits
    assert not torch.allclose(part_exact, part_br)


def test_prefix_conditioned_chunk_differs_but_blends_exactly_at_one():
    engine = make_engine("llama")
    prefix = engine.tokenize(PREFIX)
    ids = engine.tokenize(CHUNKS[1])
    plain = engine.prefill_chunk(ids)
    conditioned = engine.prefill_chunk(ids, prefix_ids=prefix)
    assert conditioned.prefix_ids == tuple(prefix) and len(conditioned) == len(ids)
    assert not torch.allclose(plain.values[1], conditioned.values[1])
    # Computed behind the prefix, a chunk placed right after that prefix is exact even at ratio 0.
    question = engine.tokenize(QUESTION)
    blended = engine.blend([prefix, conditioned, question], config=BlendConfig(recompute_ratio=0.0))
    full = engine.full_prefill(prefix + ids + question)
    torch.testing.assert_close(blended.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_batched_prefill_matches_single():
    engine = make_engine("qwen3")
    ids = [engine.tokenize(c) for c in CHUNKS]
    batched = engine.prefill_chunks(ids, batch_size=3)
    for token_ids, chunk in zip(ids, batched):
        single = engine.prefill_chunk(token_ids)
        assert chunk.token_ids == tuple(token_ids)
        for layer in range(engine.num_layers):
            torch.testing.assert_close(chunk.keys[layer], single.keys[layer], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(chunk.values[layer], single.values[layer], atol=1e-5, rtol=1e-5)


def test_sliding_window_model_blends_exactly():
    engine = tiny_engine("mistral", sliding_window=16)
    segments, full_ids, _ = build_prompt(engine)
    assert len(full_ids) > 16
    blended = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0))
    torch.testing.assert_close(blended.logits, engine.full_prefill(full_ids).logits, atol=1e-4, rtol=1e-4)


def test_gradual_reaches_budget_even_at_last_check_layer():
    engine = make_engine("llama")
    segments, _, chunks = build_prompt(engine)
    n_cached = sum(len(c) for c in chunks)
    for check_layer in range(engine.num_layers):
        cfg = BlendConfig(recompute_ratio=0.3, selection="gradual", check_layer=check_layer)
        assert engine.blend(segments, config=cfg).stats.recomputed_tokens == round(0.3 * n_cached)


@pytest.mark.parametrize("profile_tokens", [None, 3])
def test_query_profiled_picks_the_tokens_the_question_attends_in_full_reuse(profile_tokens):
    """Recompute the profile independently: the model's own eager attention of the question over
    the full-reuse cache, normalised per layer and head over the cached tokens. With
    ``profile_tokens`` only the question's last tokens run, at their own positions, and never see
    the question's earlier tokens."""
    engine = make_engine("llama")
    segments, full_ids, chunks = build_prompt(engine)
    n, q_len = len(full_ids), len(segments[-1].token_ids)
    kept = q_len if profile_tokens is None else profile_tokens
    assert kept < q_len or profile_tokens is None  # the truncated case must drop something
    start = len(segments[0].token_ids)
    n_cached = sum(len(c) for c in chunks)
    reuse_cache = engine.blend(segments, config=BlendConfig(recompute_ratio=0.0)).cache
    reuse_cache.crop(-q_len)
    model = engine.model
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=torch.tensor([full_ids[n - kept:]]), cache=reuse_cache,
                    position_ids=torch.arange(n - kept, n).unsqueeze(0), output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    scores = torch.zeros(n_cached)
    assert BlendConfig().profile_layers is None  # every layer by default
    for layer_attention in out.attentions:  # [1, heads, q_len, n]
        mass = layer_attention[0].float().sum(dim=1)[:, start:start + n_cached]
        scores += (mass / mass.sum(dim=1, keepdim=True)).sum(dim=0)
    budget = selection_budget(0.3, n_cached)
    expected = sorted((start + torch.topk(scores, budget).indices).tolist())
    blended = engine.blend(segments, config=BlendConfig(recompute_ratio=0.3, selection="query_profiled",
                                                        profile_tokens=profile_tokens))
    assert blended.stats.selected_positions == expected
    assert blended.stats.timings["profile"] > 0


def test_query_profiled_leaves_the_glue_between_chunks_out_of_its_pass():
    """Fresh glue between cached chunks (a separator; in a chat, a turn's template) is left out of the
    profile pass and hidden from the question, like the question's dropped opening: recomputed
    independently, the question's eager attention over the full-reuse cache with those keys masked.
    The blend still computes the glue exactly: at ratio 1.0 it equals full prefill."""
    engine = make_engine("llama")
    glue = engine.tokenize("\n---\n")
    lead, question = engine.tokenize(PREFIX), engine.tokenize(QUESTION)
    chunk_ids = [engine.tokenize(c) for c in CHUNKS]
    chunks = engine.prefill_chunks(chunk_ids)
    segments = [FreshSegment(lead), CachedSegment(chunks[0]), FreshSegment(glue), CachedSegment(chunks[1]),
                FreshSegment(glue), CachedSegment(chunks[2]), FreshSegment(question)]
    full_ids = [t for s in segments for t in s.token_ids]
    n, q_len = len(full_ids), len(question)
    cached = torch.zeros(n, dtype=torch.bool)
    offset = 0
    for s in segments:
        cached[offset:offset + len(s.token_ids)] = isinstance(s, CachedSegment)
        offset += len(s.token_ids)
    glue_pos = (~cached).nonzero().flatten()
    glue_pos = glue_pos[(glue_pos >= len(lead)) & (glue_pos < n - q_len)]
    assert glue_pos.numel() == 2 * len(glue)
    reuse_cache = engine.blend(segments, config=BlendConfig(recompute_ratio=0.0)).cache
    reuse_cache.crop(-q_len)
    visible = torch.ones(1, n, dtype=torch.long)
    visible[0, glue_pos] = 0
    model = engine.model
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=torch.tensor([question]), cache=reuse_cache, attention_mask=visible,
                    position_ids=torch.arange(n - q_len, n).unsqueeze(0), output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    scores = torch.zeros(int(cached.sum()))
    for layer_attention in out.attentions:  # [1, heads, q_len, n]
        mass = layer_attention[0].float().sum(dim=1)[:, cached]
        scores += (mass / mass.sum(dim=1, keepdim=True)).sum(dim=0)
    budget = selection_budget(0.3, int(cached.sum()))
    cached_pos = cached.nonzero().flatten()
    expected = sorted(cached_pos[torch.topk(scores, budget).indices].tolist())
    config = BlendConfig(recompute_ratio=0.3, selection="query_profiled", profile_tokens=None)
    assert engine.blend(segments, config=config).stats.selected_positions == expected
    exact = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0))
    torch.testing.assert_close(exact.logits, engine.full_prefill(full_ids).logits, atol=1e-4, rtol=1e-4)


def test_check_layer_defaults_to_the_strategys_own():
    engine = make_engine("llama")
    assert engine.plan(BlendConfig(selection="kv_deviation"))[1] == 1
    assert engine.plan(BlendConfig(selection="query_profiled"))[1] == 0
    assert engine.plan(BlendConfig(selection="query_profiled", check_layer=2))[1] == 2
    # Switching strategy on a config keeps following the strategy when check_layer was left unset.
    assert engine.plan(BlendConfig(selection="query_profiled").with_overrides(selection="gradual"))[1] == 1


def test_unknown_strategy_is_refused_where_the_config_is_first_used():
    engine = make_engine("llama")
    segments, _, _ = build_prompt(engine)
    with pytest.raises(Exception, match=r"selection='nope' is not supported; choose one of"):
        engine.blend(segments, config=BlendConfig(selection="nope"))
    with pytest.raises(Exception, match=r"selection='nope' is not supported"):
        tiny_engine("llama", config=BlendConfig(selection="nope"))


def test_query_profiled_with_early_full_layers_is_exact_at_one_and_differs_below():
    engine = make_engine("qwen3")
    segments, full_ids, _ = build_prompt(engine)
    full = engine.full_prefill(full_ids).logits
    exact = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, selection="query_profiled", check_layer=1))
    torch.testing.assert_close(exact.logits, full, atol=1e-4, rtol=1e-4)
    partial = engine.blend(segments, config=BlendConfig(recompute_ratio=0.3, selection="query_profiled", check_layer=1))
    reuse = engine.blend(segments, config=BlendConfig(recompute_ratio=0.0))
    assert (partial.logits - full).abs().max() < (reuse.logits - full).abs().max()


@pytest.mark.parametrize("profile_layers", [1, 2, 3, 4])
def test_query_profiled_at_any_profile_depth_is_exact_at_one_and_keeps_its_budget(profile_layers):
    engine = make_engine("llama")
    segments, full_ids, chunks = build_prompt(engine)
    exact = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, selection="query_profiled",
                                                      profile_layers=profile_layers))
    torch.testing.assert_close(exact.logits, engine.full_prefill(full_ids).logits, atol=1e-4, rtol=1e-4)
    partial = engine.blend(segments, config=BlendConfig(recompute_ratio=0.3, selection="query_profiled",
                                                        profile_layers=profile_layers))
    assert partial.stats.recomputed_tokens == selection_budget(0.3, sum(len(c) for c in chunks))


@pytest.mark.parametrize("profile_tokens", [1, 2, 1000])
def test_query_profiled_on_part_of_the_question_is_exact_at_one_and_keeps_its_budget(profile_tokens):
    engine = make_engine("qwen2")
    segments, full_ids, chunks = build_prompt(engine)
    exact = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, profile_tokens=profile_tokens))
    torch.testing.assert_close(exact.logits, engine.full_prefill(full_ids).logits, atol=1e-4, rtol=1e-4)
    partial = engine.blend(segments, config=BlendConfig(recompute_ratio=0.3, profile_tokens=profile_tokens))
    assert partial.stats.recomputed_tokens == selection_budget(0.3, sum(len(c) for c in chunks))
    assert torch.isfinite(partial.logits).all()


def test_profile_tokens_must_be_positive():
    with pytest.raises(Exception, match=r"profile_tokens=0 is out of range"):
        BlendConfig(profile_tokens=0)


def test_profile_layers_beyond_the_model_fails():
    engine = make_engine("llama")
    segments, _, _ = build_prompt(engine)
    with pytest.raises(Exception, match=r"profile_layers=9 is out of range for a model with 4 layers"):
        engine.blend(segments, config=BlendConfig(selection="query_profiled", profile_layers=9))


@pytest.mark.parametrize("strategy", available_strategies())
def test_cached_lead_is_an_exact_prefix(strategy):
    """A cached chunk that opens the prompt, computed behind nothing, holds full prefill's own K/V:
    it is reused as is, never chosen, and left out of the budget."""
    engine = make_engine("llama")
    segments, full_ids, chunks = build_prompt(engine)
    lead = engine.prefill_chunk(segments[0].token_ids)
    with_cached_lead = [CachedSegment(lead), *segments[1:]]
    n_lead, n_blendable = len(lead), sum(len(c) for c in chunks)
    exact = engine.blend(with_cached_lead, config=BlendConfig(recompute_ratio=1.0, selection=strategy))
    torch.testing.assert_close(exact.logits, engine.full_prefill(full_ids).logits, atol=1e-4, rtol=1e-4)
    for ratio in (0.0, 0.3):
        cfg = BlendConfig(recompute_ratio=ratio, selection=strategy)
        cached = engine.blend(with_cached_lead, config=cfg)
        fresh = engine.blend(segments, config=cfg)
        torch.testing.assert_close(cached.logits, fresh.logits, atol=1e-4, rtol=1e-4)
        assert cached.stats.selected_positions == fresh.stats.selected_positions
        assert all(p >= n_lead for p in cached.stats.selected_positions)
        assert cached.stats.recomputed_tokens == selection_budget(ratio, n_blendable)
        assert cached.stats.cached_tokens == n_lead + n_blendable
        assert cached.stats.reused_tokens == n_lead + n_blendable - cached.stats.recomputed_tokens


def test_a_lead_computed_behind_a_prefix_is_blended_like_any_chunk():
    engine = make_engine("llama")
    segments, _, chunks = build_prompt(engine)
    lead = engine.prefill_chunk(segments[0].token_ids, prefix_ids=engine.tokenize("Note:"))
    blended = engine.blend([CachedSegment(lead), *segments[1:]], config=BlendConfig(recompute_ratio=0.3))
    assert blended.stats.recomputed_tokens == selection_budget(0.3, len(lead) + sum(len(c) for c in chunks))


def test_chunks_computed_behind_exactly_what_precedes_them_are_exact():
    engine = make_engine("llama")
    segments, full_ids, chunks = build_prompt(engine)
    lead_ids = list(segments[0].token_ids)
    first = engine.prefill_chunk(chunks[0].token_ids, prefix_ids=lead_ids)  # behind exactly the lead
    prompt = [CachedSegment(engine.prefill_chunk(lead_ids)), CachedSegment(first), *segments[2:]]
    blended = engine.blend(prompt, config=BlendConfig(recompute_ratio=0.3))
    n_exact = len(lead_ids) + len(first)
    assert blended.stats.recomputed_tokens == selection_budget(0.3, sum(len(c) for c in chunks[1:]))
    assert all(p >= n_exact for p in blended.stats.selected_positions)
    # Everything cached but exact: nothing to blend, and the result is full prefill's.
    only_exact = [CachedSegment(engine.prefill_chunk(lead_ids)), FreshSegment(full_ids[len(lead_ids):])]
    torch.testing.assert_close(engine.blend(only_exact, config=BlendConfig(recompute_ratio=0.15)).logits,
                               engine.full_prefill(full_ids).logits, atol=1e-4, rtol=1e-4)
