"""The MuSiQue prompt: chat template, passages as separately tokenized chunks."""

from __future__ import annotations

import json

import pytest

from cacheblend_rag.bench.prompt import (
    PASSAGES_HEADER,
    SYSTEM_INSTRUCTION,
    MusiqueExample,
    build_prompt,
    load_musique,
    passage_text,
)
from cacheblend_rag.kv.segments import FreshSegment, StoredSegment
from cacheblend_rag.errors import BlendInputError, ConfigError
from cacheblend_rag.testing import tiny_tokenizer
from cacheblend_rag.reuse.prompt import STAND_IN_PASSAGE


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def example() -> MusiqueExample:
    return MusiqueExample(
        question="What is the capital of France?",
        answers=["Paris"],
        passages=[("France", "Paris is the capital of France."), ("", "The quick brown fox."), ("Dog", "The lazy dog.")],
    )


def test_pieces_are_tokenized_alone_and_cover_the_rendered_prompt(tokenizer):
    prompt = build_prompt(tokenizer, example(), passages=2)
    tok = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert prompt.passage_texts == [passage_text("France", "Paris is the capital of France."),
                                    passage_text("", "The quick brown fox.")]
    assert prompt.chunk_ids == [tok(t) for t in prompt.passage_texts]
    assert tokenizer.decode(prompt.input_ids) == prompt.text
    lead = tokenizer.decode(prompt.lead_ids)
    assert SYSTEM_INSTRUCTION in lead and lead.endswith(PASSAGES_HEADER)
    tail = tokenizer.decode(prompt.tail_ids)
    assert "What is the capital of France?" in tail and tail.endswith("<|im_start|>assistant\n")
    assert prompt.num_tokens == len(prompt.input_ids)
    assert prompt.prefix_cache_length == len(prompt.lead_ids) + len(prompt.chunk_ids[0])


def test_segments_and_conditioning_prefix(tokenizer):
    prompt = build_prompt(tokenizer, example(), passages=3)
    plain = prompt.stored_segments(prompt.conditioning_prefix(False))
    conditioned = prompt.stored_segments(prompt.conditioning_prefix(True))
    # The lead is stored behind nothing (an exact prefix of every blend); the question stays fresh.
    assert isinstance(plain[0], StoredSegment) and plain[0].prefix_ids == () and conditioned[0].prefix_ids == ()
    assert plain[0].token_ids == tuple(prompt.lead_ids) and isinstance(plain[-1], FreshSegment)
    assert [s.token_ids for s in plain[1:-1]] == [tuple(c) for c in prompt.chunk_ids]
    assert all(isinstance(s, StoredSegment) and s.prefix_ids == () for s in plain[1:-1])
    # The conditioning prefix is the text that precedes the passages in the prompt, then the stand-in passage.
    stand_in = tuple(tokenizer(STAND_IN_PASSAGE, add_special_tokens=False)["input_ids"])
    assert all(s.prefix_ids == tuple(prompt.lead_ids) + stand_in for s in conditioned[1:-1])


def test_max_passage_tokens_truncates_text(tokenizer):
    long = MusiqueExample("Q?", ["a"], [("T", "The quick brown fox jumps over the lazy dog. " * 10)])
    full = build_prompt(tokenizer, long, passages=1)
    cut = build_prompt(tokenizer, long, passages=1, max_passage_tokens=5)
    assert len(cut.chunk_ids[0]) < len(full.chunk_ids[0])
    assert cut.passage_texts[0].startswith("T\n\n") and cut.passage_texts[0].endswith("\n\n")


def test_needs_a_chat_template(tokenizer):
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        build_prompt(bare, example(), passages=2)


def test_empty_passages_are_rejected(tokenizer):
    with pytest.raises(BlendInputError, match="no non-empty passage"):
        build_prompt(tokenizer, MusiqueExample("Q?", ["a"], [("", "  ")]), passages=1)


def test_load_musique_validates(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"question": "Q?", "answers": "A", "ctxs": [{"title": None, "text": "x"}]}] * 3))
    examples = load_musique(good, n=2)
    assert len(examples) == 2 and examples[0].answers == ["A"] and examples[0].passages == [("", "x")]
    with pytest.raises(ConfigError, match="not found"):
        load_musique(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"question": "Q?", "ctxs": []}]))
    with pytest.raises(ConfigError, match="lacks answers"):
        load_musique(bad)
