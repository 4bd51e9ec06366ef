"""An answer's deltas as the integrations stream them: thinking apart from the answer, and with tools
bound, a call made after the thinking read as a call, wherever the text is cut."""

from __future__ import annotations

import random

import pytest

from cacheblend_rag.serving.answer_stream import AnswerStream
from cacheblend_rag.serving.thinking import ThinkingStream, Thought
from cacheblend_rag.serving.tool_stream import ToolCallStream
from cacheblend_rag.serving.tools import call_text
from cacheblend_rag.testing import THINKING_TEMPLATE, tiny_tokenizer

WEATHER = {"name": "weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = call_text("weather", {"city": "Paris"})


def _cuts(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(stream: AnswerStream, parts: list[str]) -> tuple[Thought, object]:
    reasoning, answer = "", ""
    for part in map(stream.feed, parts):
        reasoning, answer = reasoning + part.reasoning, answer + part.answer
    rest, call = stream.finish()
    return Thought(reasoning + rest.reasoning, answer + rest.answer), call


@pytest.mark.parametrize(("text", "reasoning", "answer", "called"), [
    (f"<think>\nParis is in France; ask the tool.\n</think>\n\n{CALL}", "Paris is in France; ask the tool.", "", True),
    ("<think>\nNo tool needed.\n</think>\n\nParis.", "No tool needed.", "Paris.", False),
    (CALL, "", "", True),
    ("Paris.", "", "Paris.", False),
])
def test_a_call_after_thinking_parses_wherever_the_stream_is_cut(text, reasoning, answer, called) -> None:
    rng = random.Random(0)
    for _ in range(100):
        parts = _cuts(text, rng)
        thought, call = _streamed(AnswerStream(ToolCallStream([WEATHER]), ThinkingStream()), parts)
        assert thought == Thought(reasoning, answer), parts
        assert (call is not None) == called and (call is None or call.arguments == {"city": "Paris"}), parts
    assert AnswerStream(ToolCallStream([WEATHER]), ThinkingStream()).read(text)[0] == Thought(reasoning, answer)


def test_answer_text_after_thinking_streams_before_the_end() -> None:
    stream = AnswerStream(ToolCallStream([WEATHER]), ThinkingStream())
    assert stream.feed("<think>\nNo tool") == Thought("No tool", "")
    assert stream.feed(" needed.</think>\n\nPar") == Thought(" needed.", "Par")  # not held: it cannot be a call
    assert stream.feed("is.") == Thought("", "is.")
    assert stream.finish() == (Thought("", ""), None)


def test_a_call_is_held_until_the_end() -> None:
    stream = AnswerStream(ToolCallStream([WEATHER]), ThinkingStream())
    assert stream.feed("<think>\nask</think>\n{") == Thought("ask", "")
    assert stream.feed(CALL[1:]) == Thought("", "")
    rest, call = stream.finish()
    assert rest == Thought("", "") and call is not None and call.name == "weather"


def test_which_models_think_and_prompts_that_open_the_thinking() -> None:
    plain, thinking = tiny_tokenizer(), tiny_tokenizer()
    thinking.chat_template = THINKING_TEMPLATE
    # A model that does not think answers with whatever text it wrote.
    assert AnswerStream.for_prompt(plain, "<|im_start|>assistant\n").read("<think>a</think>b")[0] == Thought(
        "", "<think>a</think>b")
    assert AnswerStream.for_prompt(thinking, "<|im_start|>assistant\n").read("<think>a</think>b")[0] == Thought(
        "a", "b")
    # The template wrote <think> itself: the answer starts inside the thinking.
    opened = AnswerStream.for_prompt(thinking, "<|im_start|>assistant\n<think>\n", ToolCallStream([WEATHER]))
    thought, call = opened.read(f"a\n</think>\n{CALL}")
    assert thought == Thought("a", "") and call is not None
