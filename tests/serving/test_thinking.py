"""A thinking model's <think>...</think> text told apart from its answer: whole, as it streams (cut
anywhere), and which tokenizers count as thinking; chat_template_kwargs' checks."""

from __future__ import annotations

import random

import pytest

from cacheblend_rag.serving.thinking import ThinkingStream, Thought, checked_template_kwargs, split_thinking, thinks
from cacheblend_rag.testing import tiny_tokenizer

TEXTS = {
    "<think>\nThe capital of France is Paris.\n</think>\n\nParis.": ("The capital of France is Paris.", "Paris."),
    "<think>\n\n</think>\n\nParis": ("", "Paris"),  # an empty thinking block
    "  <think> a < b </think> c": ("a < b", "c"),
    "<think>ran out of tokens  ": ("ran out of tokens", ""),
    "Paris <think> is not thinking</think>": ("", "Paris <think> is not thinking</think>"),
    "<th is not a tag": ("", "<th is not a tag"),
    "Paris.": ("", "Paris."),
    "": ("", ""),
}


@pytest.mark.parametrize("text", list(TEXTS))
def test_split_thinking(text: str) -> None:
    assert split_thinking(text) == Thought(*TEXTS[text])


def _streamed(parts: list[str], opened: bool = False) -> tuple[str, str]:
    stream, reasoning, answer = ThinkingStream(opened), "", ""
    for part in [*map(stream.feed, parts), stream.finish()]:
        reasoning, answer = reasoning + part.reasoning, answer + part.answer
    return reasoning, answer


@pytest.mark.parametrize("text", list(TEXTS))
def test_a_stream_cut_anywhere_splits_as_the_whole_text(text: str) -> None:
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _streamed(parts) == TEXTS[text], parts


def test_a_prompt_that_opens_the_thinking() -> None:
    # The template wrote <think> itself: the text starts inside it, and only </think> ends it.
    assert _streamed(["The capital", " is Paris.\n</th", "ink>\n\nParis."], opened=True) == (
        "The capital is Paris.", "Paris.")
    assert split_thinking("The capital is Paris.\n</think>\n\nParis.") == ("The capital is Paris.", "Paris.")


def test_only_tokenizers_that_know_the_tags_think() -> None:
    tokenizer = tiny_tokenizer()
    assert not thinks(tokenizer)
    tokenizer.chat_template += "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert thinks(tokenizer)
    vocab = tiny_tokenizer()
    vocab.add_tokens(["<think>", "</think>"], special_tokens=True)
    assert thinks(vocab)


def test_chat_template_kwargs_are_checked() -> None:
    assert checked_template_kwargs("LLM", {"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(ValueError, match="must be a dict"):
        checked_template_kwargs("LLM", "enable_thinking=False")
    with pytest.raises(ValueError, match=r"sets \['tokenize'\], which LLM passes itself"):
        checked_template_kwargs("LLM", {"tokenize": True})
