"""Constrained decoding: JSON that always parses, closed before the token budget runs out, and an
optional mode where the first token decides between text and a call held to its schema."""

from __future__ import annotations

import json

import pytest
import torch

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.engine.constraints import JsonConstraint, _index
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import tiny_engine

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"]}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def _prompt(engine, text: str) -> list[list[int]]:
    return [engine.tokenizer.encode(text)]


def _fewest_tokens(engine, schema) -> int:
    from outlines_core.json_schema import build_regex_from_schema

    from cacheblend_rag.engine.constraints import WHITESPACE

    regex = build_regex_from_schema(json.dumps(schema), WHITESPACE)
    _, index = _index(engine.tokenizer, engine.tokenizer.eos_token_id, regex)
    return index.remaining[index.index.get_initial_state()]


def test_constrained_json_always_parses_whatever_the_budget(engine):
    """A random model never ends its string by itself: every answer here is closed by the budget."""
    fewest = _fewest_tokens(engine, SCHEMA)
    for budget in (fewest, fewest + 1, fewest + 7, fewest + 40):
        result = engine.generate(_prompt(engine, "Is water wet?"), max_new_tokens=budget, json_schema=json.dumps(SCHEMA))
        value = json.loads(result.text)
        assert set(value) == {"answer", "sure"} and isinstance(value["sure"], bool)
        assert len(result.token_ids) <= budget


def test_min_new_tokens_does_not_keep_a_finished_json_answer_open():
    """Once the JSON is complete its constraint allows only end-of-sequence; min_new_tokens must not
    mask that too (every token impossible) but let the answer end."""
    from cacheblend_rag.engine.generate import TokenSampler

    class OnlyEos:
        def mask(self, logits, generated):
            return torch.full_like(logits, float("-inf")).index_fill(-1, torch.tensor([2]), 0.0)

    cfg = GenerationConfig(max_new_tokens=8, min_new_tokens=8).resolved()
    assert TokenSampler(cfg, constraint=OnlyEos(), eos=[2])(torch.randn(10), [5]) == 2
    assert TokenSampler(cfg, eos=[2])(torch.arange(10.0).flip(0).roll(-8), [5]) != 2  # unconstrained: held back


def test_a_budget_too_small_for_any_json_is_cut_not_broken(engine):
    fewest = _fewest_tokens(engine, SCHEMA)
    result = engine.generate(_prompt(engine, "Is water wet?"), max_new_tokens=fewest - 1, json_schema=json.dumps(SCHEMA))
    assert result.finish_reason == "length" and len(result.token_ids) == fewest - 1
    assert result.text.startswith("{")


def _first_token_logits(engine, text: str) -> torch.Tensor:
    """Logits that favour the token ``text`` above all others (and after it, nothing in particular)."""
    vocab = engine.model.config.vocab_size
    logits = torch.zeros(vocab)
    logits[engine.tokenizer.convert_tokens_to_ids(text)] = 10.0
    return logits


@pytest.mark.parametrize("favoured", ["{", "[", "Ġ", "Ċ"])
def test_optional_json_starts_a_call_only_through_the_constraint(engine, favoured):
    """``json_only=False``: a first token that starts JSON is the constraint's own; one that would
    start other JSON (``[``) or leave the choice open (whitespace) is not allowed."""
    if engine.tokenizer.convert_tokens_to_ids(favoured) == engine.tokenizer.unk_token_id:
        pytest.skip(f"{favoured!r} is not a token of the tiny vocabulary")
    constraint = JsonConstraint(engine.tokenizer, engine.tokenizer.eos_token_id, SCHEMA, optional=True)
    masked = constraint.mask(_first_token_logits(engine, favoured), [])
    first = int(torch.argmax(masked))
    if favoured == "{":
        assert first == engine.tokenizer.convert_tokens_to_ids("{")
        constraint.mask(torch.zeros_like(masked), [first])
        assert not constraint.free
    else:
        assert masked[engine.tokenizer.convert_tokens_to_ids(favoured)] == float("-inf")


def test_optional_json_leaves_a_text_answer_free(engine):
    constraint = JsonConstraint(engine.tokenizer, engine.tokenizer.eos_token_id, SCHEMA, optional=True)
    letter = engine.tokenizer.convert_tokens_to_ids("T")
    first = int(torch.argmax(constraint.mask(_first_token_logits(engine, "T"), [])))
    assert first == letter
    logits = torch.randn(engine.model.config.vocab_size)
    assert torch.equal(constraint.mask(logits, [letter]), logits) and constraint.free


def test_optional_json_in_generation_is_text_or_a_complete_call(engine):
    for seed in range(4):
        result = engine.generate(_prompt(engine, "Say something."), max_new_tokens=24, json_schema=json.dumps(SCHEMA),
                                 json_only=False, temperature=1.0, seed=seed)
        if result.text.startswith("{"):
            assert set(json.loads(result.text)) == {"answer", "sure"}
        else:
            assert not result.text.lstrip().startswith(("{", "["))


def test_json_only_must_be_a_bool():
    with pytest.raises(ConfigError, match="json_only"):
        GenerationConfig(json_schema="{}", json_only="no")
