"""The one-time correctness gate, and decoding: streaming, stop strings, sampling."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig, CorrectnessGateError
from cacheblend_rag.engine import gate
from cacheblend_rag.engine.blend import DEFAULT_MIN_BLEND_TOKENS
from cacheblend_rag.testing import tiny_engine


def _prompt(engine):
    chunk = engine.prefill_chunk(engine.tokenize("Paris is the capital of France. The quick brown fox."))
    return [engine.tokenize("Context:\n"), chunk, engine.tokenize("\nQuestion: What is the capital? Answer:")]


def _break_layer(engine):
    """Make the layer-wise path disagree with the model's own forward (a broken adapter)."""
    original = engine.adapter.mlp_block
    engine.adapter.mlp_block = lambda layer, hidden: original(layer, hidden) * 1.5


def test_gate_passes_and_is_memoised():
    engine = tiny_engine("llama", seed=101)
    engine.blend(_prompt(engine))
    key = (engine.fingerprint, str(engine.device))
    assert gate.RESULTS[key][0] is True
    calls = []
    engine.run_gate = lambda cfg: calls.append(cfg) or (True, 0.0)
    engine.blend(_prompt(engine))
    assert calls == []


def test_gate_failure_refuses_to_blend():
    engine = tiny_engine("llama", seed=102)
    _break_layer(engine)
    with pytest.raises(CorrectnessGateError, match="fallback_to_full_prefill=True"):
        engine.blend(_prompt(engine))


def test_gate_blends_even_when_the_engine_falls_back_on_short_prompts():
    """A real engine's default min_blend_tokens (128) is above the gate's 34 cached tokens: the gate's own blend
    must not fall back to full prefill, or it compares full prefill with itself and a broken layer passes."""
    engine = tiny_engine("llama", seed=104)
    engine.min_blend_tokens = DEFAULT_MIN_BLEND_TOKENS
    _break_layer(engine)
    ok, err = engine.run_gate(BlendConfig())
    assert not ok and err > 1e-3


def test_gate_failure_falls_back_to_full_prefill_when_configured():
    engine = tiny_engine("llama", seed=103, config=BlendConfig(fallback_to_full_prefill=True))
    _break_layer(engine)
    segments = _prompt(engine)
    result = engine.blend(segments)
    assert result.stats.mode == "full_prefill"
    assert "correctness gate" in result.stats.fallback_reason
    ids = [t for s in segments for t in (s.token_ids if hasattr(s, "token_ids") else s)]
    torch.testing.assert_close(result.logits, engine.full_prefill(ids).logits)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=7)


def test_stream_deltas_join_to_generated_text(engine):
    segments = _prompt(engine)
    stream = engine.stream(segments, max_new_tokens=16)
    deltas = list(stream)
    result = stream.result()
    assert "".join(deltas) == result.text
    assert result.text == engine.generate(segments, max_new_tokens=16).text
    assert result.ttft_s > 0 and result.total_s >= result.ttft_s


def test_stop_string_cuts_text(engine):
    segments = _prompt(engine)
    full = engine.generate(segments, max_new_tokens=24).text
    assert len(full) > 4
    stop = full[2:4]
    out = engine.generate(segments, max_new_tokens=24, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]
    streamed = "".join(engine.stream(segments, max_new_tokens=24, stop=[stop]))
    assert streamed == out.text


def test_max_new_tokens_and_length_finish(engine):
    out = engine.generate(_prompt(engine), max_new_tokens=3)
    assert len(out.token_ids) <= 3
    if len(out.token_ids) == 3:
        assert out.finish_reason == "length"


def test_eos_stops_generation(engine):
    segments = _prompt(engine)
    first = engine.generate(segments, max_new_tokens=1).token_ids[0]
    engine.model.generation_config.eos_token_id = first
    try:
        out = engine.generate(segments, max_new_tokens=5)
    finally:
        engine.model.generation_config.eos_token_id = engine.tokenizer.eos_token_id
    assert out.finish_reason == "eos" and out.token_ids == [] and out.text == ""


def test_min_new_tokens_holds_eos_back_until_reached(engine):
    segments = _prompt(engine)
    first = engine.generate(segments, max_new_tokens=1).token_ids[0]
    engine.model.generation_config.eos_token_id = first
    try:
        out = engine.generate(segments, max_new_tokens=6, min_new_tokens=6)
        early = engine.generate(segments, max_new_tokens=6, min_new_tokens=2)
    finally:
        engine.model.generation_config.eos_token_id = engine.tokenizer.eos_token_id
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and first not in out.token_ids
    assert len(early.token_ids) >= 2 and first not in early.token_ids[:2]


def test_min_new_tokens_above_max_new_tokens_is_refused():
    from cacheblend_rag import GenerationConfig
    from cacheblend_rag.errors import ConfigError

    with pytest.raises(ConfigError, match="min_new_tokens=9 is above max_new_tokens=4"):
        GenerationConfig(max_new_tokens=4, min_new_tokens=9)


def test_sampling_is_reproducible_with_seed(engine):
    segments = _prompt(engine)
    a = engine.generate(segments, max_new_tokens=12, temperature=1.5, top_p=0.9, top_k=50, seed=3)
    b = engine.generate(segments, max_new_tokens=12, temperature=1.5, top_p=0.9, top_k=50, seed=3)
    greedy = engine.generate(segments, max_new_tokens=12)
    assert a.token_ids == b.token_ids
    samples = {tuple(engine.generate(segments, max_new_tokens=12, temperature=2.0, seed=s).token_ids) for s in range(4)}
    assert len(samples | {tuple(greedy.token_ids)}) > 1


def test_top_k_one_is_greedy(engine):
    segments = _prompt(engine)
    greedy = engine.generate(segments, max_new_tokens=10)
    sampled = engine.generate(segments, max_new_tokens=10, temperature=1.0, top_k=1, seed=0)
    assert sampled.token_ids == greedy.token_ids


def test_full_prefill_is_blend_with_only_fresh_segments(engine):
    ids = engine.tokenize("Context: Paris is the capital of France. Question: capital? Answer:")
    blended = engine.blend([ids[:5], ids[5:]])
    assert blended.stats.mode == "full_prefill"
    torch.testing.assert_close(blended.logits, engine.full_prefill(ids).logits)


def test_the_blend_that_runs_the_gate_says_what_it_cost_and_later_blends_do_not():
    engine = tiny_engine("llama", seed=105)
    first, second = engine.blend(_prompt(engine)), engine.blend(_prompt(engine))
    assert 0 < first.stats.timings["gate"] < first.stats.timings["total"]
    assert "gate" not in second.stats.timings
