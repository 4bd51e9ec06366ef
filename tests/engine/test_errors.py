"""Bad input gets an error that names what is wrong and how to fix it."""

from __future__ import annotations

import pytest

from cacheblend_rag import (
    BlendConfig,
    BlendInputError,
    CacheBlendEngine,
    ChunkMismatchError,
    ConfigError,
    GenerationConfig,
    UnsupportedArchitectureError,
)
from cacheblend_rag.testing import tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def test_empty_segment_list(engine):
    with pytest.raises(BlendInputError, match="segments is empty"):
        engine.blend([])


def test_no_fresh_tokens_at_the_end(engine):
    chunk = engine.prefill_chunk(engine.tokenize("Paris is the capital of France."))
    with pytest.raises(BlendInputError, match="last segment must be fresh"):
        engine.blend([engine.tokenize("Context:"), chunk])


def test_prompt_longer_than_context():
    small = tiny_engine("llama", max_position_embeddings=32)
    chunk = small.prefill_chunk(list(range(10, 30)))
    with pytest.raises(BlendInputError, match="context window of 32"):
        small.blend([chunk, list(range(40, 60))])


def test_chunk_from_another_model(engine):
    other = tiny_engine("qwen3")  # other head_dim and layout
    chunk = other.prefill_chunk(other.tokenize("Paris is the capital of France."))
    with pytest.raises(ChunkMismatchError, match="computed by another model"):
        engine.blend([chunk, engine.tokenize("Question?")])


def test_chunk_with_same_shape_from_other_weights(engine):
    twin = tiny_engine("llama", seed=1)  # same shapes, different weights
    chunk = twin.prefill_chunk(twin.tokenize("Paris is the capital of France."))
    with pytest.raises(ChunkMismatchError, match="fingerprint"):
        engine.blend([chunk, engine.tokenize("Question?")])


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), "0.5"])
def test_ratio_out_of_range(ratio):
    with pytest.raises(ConfigError, match="recompute_ratio"):
        BlendConfig(recompute_ratio=ratio)


def test_check_layer_out_of_range(engine):
    with pytest.raises(ConfigError, match=r"check_layer=7 .* allowed range is \[0, 3\]"):
        CacheBlendEngine(engine.model, engine.tokenizer, config=BlendConfig(check_layer=7))


@pytest.mark.parametrize(
    "field, value, message",
    [("mask", "causal", "mask"), ("deviation", "both", "deviation"), ("selection", "", "selection"),
     ("selection", 3, "selection")],
)
def test_bad_choices(field, value, message):
    with pytest.raises(ConfigError, match=message):
        BlendConfig(**{field: value})


def test_unregistered_strategy_fails_when_an_engine_takes_the_config(engine):
    """Strategies are an open registry of the engine's, so the config checks only that a name is
    given; the engine checks it against the registry, naming what is registered."""
    with pytest.raises(ConfigError, match=r"selection='magic' is not supported; choose one of .*'kv_deviation'"):
        CacheBlendEngine(engine.model, engine.tokenizer, config=BlendConfig(selection="magic"))


def test_bad_generation_options(engine):
    with pytest.raises(ConfigError, match="top_p"):
        GenerationConfig(top_p=0)
    with pytest.raises(BlendInputError, match="unknown generation option"):
        engine.generate([engine.tokenize("Hi")], max_tokens=3)


def test_unsupported_architecture_lists_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedArchitectureError, match="llama, mistral, qwen2, qwen3"):
        CacheBlendEngine(model)


def test_unsupported_architecture_can_fall_back_to_full_prefill():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).eval()
    engine = CacheBlendEngine(model, config=BlendConfig(fallback_to_full_prefill=True))
    result = engine.blend([[1, 2, 3], [4, 5]])
    assert result.stats.mode == "full_prefill"
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        engine.prefill_chunk([1, 2, 3])


def test_segment_of_wrong_type(engine):
    with pytest.raises(BlendInputError, match="cannot use str as a segment"):
        engine.blend(["some text", [1, 2]])


def test_stored_segment_without_store(engine):
    from cacheblend_rag import StoredSegment

    with pytest.raises(BlendInputError, match="no store was given"):
        engine.blend([StoredSegment([5, 6, 7]), [1, 2]])
