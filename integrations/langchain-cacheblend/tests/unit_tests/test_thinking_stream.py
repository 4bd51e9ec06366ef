"""A thinking model's answer streamed: its thinking as ``additional_kwargs["reasoning_content"]`` chunks
(as langchain-ollama streams it), the answer as content, and with tools bound, a call made after the
thinking still read as a call; sync and async. The tiny thinking Qwen3 runs each request for real, its
random text replaced by a scripted one (cacheblend_rag.testing.script_answers)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.tools import tool

from cacheblend_rag.serving.tools import call_text
from cacheblend_rag.testing import script_answers, tiny_engine, tiny_thinking_engine
from langchain_cacheblend import ChatCacheBlend

ANSWER = ["<think>\nThe capital", " of France is Paris.\n</th", "ink>\n\nPar", "is."]
CALL = ["<think>\nAsk the tool.", "\n</think>\n", call_text("weather", {"city": "Paris"})[:9],
        call_text("weather", {"city": "Paris"})[9:]]


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@pytest.fixture(scope="module")
def qwen3():
    return tiny_thinking_engine()


def scripted(engine: Any, pieces: list[str], monkeypatch: pytest.MonkeyPatch) -> ChatCacheBlend:
    llm = ChatCacheBlend(engine=engine, max_tokens=3)
    script_answers(llm, monkeypatch, *[pieces] * 4)
    return llm


def streamed(runnable: Any, question: str, run_async: bool) -> list[AIMessageChunk]:
    if not run_async:
        return list(runnable.stream(question))

    async def collect() -> list[AIMessageChunk]:
        return [chunk async for chunk in runnable.astream(question)]

    return asyncio.run(collect())


@pytest.mark.parametrize("run_async", [False, True])
def test_thinking_streams_as_reasoning_content(qwen3, monkeypatch, run_async) -> None:
    chunks = streamed(scripted(qwen3, ANSWER, monkeypatch), "What is the capital of France?", run_async)
    reasoning = [c.additional_kwargs.get("reasoning_content", "") for c in chunks]
    # Thinking comes in more than one chunk, before any answer text, and no chunk shows a tag.
    assert sum(bool(r) for r in reasoning) >= 2
    first_answer = next(i for i, c in enumerate(chunks) if c.content)
    assert all(not r for r in reasoning[first_answer:])
    assert not any("think>" in c.content or "think>" in r for c, r in zip(chunks, reasoning))
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == "Paris."
    assert whole.additional_kwargs["reasoning_content"] == "The capital of France is Paris."
    assert whole.content_blocks[0] == {"type": "reasoning", "reasoning": "The capital of France is Paris."}
    assert whole.usage_metadata["output_tokens"] > 0  # the request's own stats


def test_invoke_gives_what_the_stream_adds_up_to(qwen3, monkeypatch) -> None:
    answer = scripted(qwen3, ANSWER, monkeypatch).invoke("What is the capital of France?")
    assert answer.content == "Paris."
    assert answer.additional_kwargs["reasoning_content"] == "The capital of France is Paris."
    assert asyncio.run(scripted(qwen3, ANSWER, monkeypatch).ainvoke("Capital?")).content == "Paris."


@pytest.mark.parametrize("run_async", [False, True])
def test_a_call_after_thinking_is_a_tool_call(qwen3, monkeypatch, run_async) -> None:
    llm = scripted(qwen3, CALL, monkeypatch).bind_tools([weather])
    chunks = streamed(llm, "What is the weather in Paris?", run_async)
    whole = sum(chunks[1:], chunks[0])
    assert whole.additional_kwargs["reasoning_content"] == "Ask the tool."
    assert whole.content == ""  # the call's JSON is no text of the answer
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("weather", {"city": "Paris"})]
    called = scripted(qwen3, CALL, monkeypatch).bind_tools([weather]).invoke("What is the weather in Paris?")
    assert called.tool_calls[0]["args"] == {"city": "Paris"} and called.additional_kwargs["reasoning_content"]


def test_a_model_that_does_not_think_streams_its_text_as_written(monkeypatch) -> None:
    chunks = list(scripted(tiny_engine("llama"), ANSWER, monkeypatch).stream("Capital?"))
    assert "".join(c.content for c in chunks) == "".join(ANSWER)
    assert not any(c.additional_kwargs for c in chunks)


def test_text_held_back_as_a_possible_call_goes_out_before_the_requests_bookkeeping(monkeypatch) -> None:
    # With tools bound, an answer that opens like a call is held until it is known; at the text's end it goes
    # out at once, not after the request's K/V is kept for the next call (what result() waits for).
    llm = scripted(tiny_engine("llama"), CALL[2:], monkeypatch)
    entered, release, left = threading.Event(), threading.Event(), threading.Event()
    keep = llm.service.reuse.keep

    def slow_keep(*args: Any) -> Any:
        entered.set()
        release.wait(5)
        left.set()
        return keep(*args)

    monkeypatch.setattr(llm.service.reuse, "keep", slow_keep)
    chunks = iter(llm.bind_tools([weather]).stream("What is the weather in Paris?"))
    try:
        first = next(chunks)
        assert [c["name"] for c in first.tool_call_chunks] == ["weather"]
        assert entered.is_set() and not left.is_set()  # the bookkeeping had begun and not finished
    finally:
        release.set()
    last = list(chunks)[-1]
    assert last.usage_metadata["output_tokens"] > 0  # the stats came after it
