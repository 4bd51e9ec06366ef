"""A thinking model's answer streamed: its thinking as ``ThinkingBlock`` deltas (``additional_kwargs
["thinking_delta"]``, which FunctionAgent's ``AgentStream`` reads, as llama-index-llms-ollama gives them)
and the answer as the text, and with tools bound, a call made after the thinking still read as a call;
sync and async, and through a FunctionAgent. The tiny thinking Qwen3 runs each request for real, its random
text replaced by a scripted one (cacheblend_rag.testing.script_answers)."""

from __future__ import annotations

import asyncio
import typing
from typing import Any, Literal

import pytest
from llama_index.core.base.llms.types import ThinkingBlock
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool

from cacheblend_rag.serving.tools import call_text
from cacheblend_rag.testing import script_answers, tiny_engine, tiny_thinking_engine
from llama_index.llms.cacheblend import CacheBlendLLM

ANSWER = ["<think>\nThe capital", " of France is Paris.\n</th", "ink>\n\nPar", "is."]
CALL = ["<think>\nAsk the tool.", "\n</think>\n", call_text("set_mode", {"mode": "safe"})[:9],
        call_text("set_mode", {"mode": "safe"})[9:]]
QUESTION = [ChatMessage(role="user", content="What is the capital of France?")]


def set_mode(mode: Literal["fast", "safe"]) -> str:
    """Switch the pipeline's mode."""
    return f"mode set to {mode}"


set_mode.__annotations__ = typing.get_type_hints(set_mode)  # resolved: LlamaIndex reads them as they are


@pytest.fixture(scope="module")
def qwen3():
    return tiny_thinking_engine()


def scripted(engine: Any, monkeypatch: pytest.MonkeyPatch, *answers: list[str]) -> CacheBlendLLM:
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=3)
    script_answers(llm, monkeypatch, *answers)
    return llm


def streamed(llm: CacheBlendLLM, run_async: bool, tools: list | None = None) -> list:
    if tools is not None:
        if not run_async:
            return list(llm.stream_chat_with_tools(tools, chat_history=QUESTION))

        async def collect_with_tools() -> list:
            return [r async for r in await llm.astream_chat_with_tools(tools, chat_history=QUESTION)]

        return asyncio.run(collect_with_tools())
    if not run_async:
        return list(llm.stream_chat(QUESTION))

    async def collect() -> list:
        return [r async for r in await llm.astream_chat(QUESTION)]

    return asyncio.run(collect())


def thinking_of(response: Any) -> list[str]:
    return [b.content for b in response.message.blocks if isinstance(b, ThinkingBlock)]


@pytest.mark.parametrize("run_async", [False, True])
def test_thinking_streams_as_thinking_deltas(qwen3, monkeypatch, run_async) -> None:
    responses = streamed(scripted(qwen3, monkeypatch, ANSWER), run_async)
    deltas = [r.additional_kwargs.get("thinking_delta") or "" for r in responses]
    # Thinking comes in more than one response, before any answer text, and no response shows a tag.
    assert sum(bool(d) for d in deltas) >= 2
    first_answer = next(i for i, r in enumerate(responses) if r.delta)
    assert not any(deltas[first_answer + 1:])
    assert "".join(deltas) == "The capital of France is Paris."
    assert "".join(r.delta or "" for r in responses) == "Paris."
    assert not any("think>" in (r.message.content or "") for r in responses)
    last = responses[-1]
    assert last.message.content == "Paris." and thinking_of(last) == ["The capital of France is Paris."]
    assert last.additional_kwargs["prompt_tokens"] > 0  # the stats still ride on the last response


@pytest.mark.parametrize("run_async", [False, True])
def test_a_call_after_thinking_is_a_tool_call(qwen3, monkeypatch, run_async) -> None:
    llm = scripted(qwen3, monkeypatch, CALL)
    tool = FunctionTool.from_defaults(fn=set_mode)
    responses = streamed(llm, run_async, tools=[tool])
    last = responses[-1]
    assert thinking_of(last) == ["Ask the tool."]
    (selection,) = llm.get_tool_calls_from_response(last)
    assert selection.tool_name == "set_mode" and selection.tool_kwargs == {"mode": "safe"}
    assert not any(r.delta for r in responses)  # the call's JSON was held, never shown as text
    # chat and achat read the whole answer as the stream does.
    whole = scripted(qwen3, monkeypatch, CALL, CALL)
    for answered in (whole.chat_with_tools([tool], chat_history=QUESTION),
                     asyncio.run(whole.achat_with_tools([tool], chat_history=QUESTION))):
        assert thinking_of(answered) == ["Ask the tool."]
        assert whole.get_tool_calls_from_response(answered)[0].tool_kwargs == {"mode": "safe"}


def test_a_function_agent_streams_the_thinking_then_calls_the_tool(qwen3, monkeypatch) -> None:
    from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCallResult

    llm = scripted(qwen3, monkeypatch, CALL, ANSWER)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=set_mode)], llm=llm)

    async def run() -> tuple[list, Any]:
        handler = agent.run(user_msg="Switch to the safe mode, then name the capital of France.")
        events = [e async for e in handler.stream_events() if isinstance(e, (AgentStream, ToolCallResult))]
        return events, await handler

    events, answer = asyncio.run(run())
    (result,) = [e for e in events if isinstance(e, ToolCallResult)]
    assert result.tool_kwargs == {"mode": "safe"}
    before, after = events[:events.index(result)], events[events.index(result):]
    assert "".join(e.thinking_delta or "" for e in before if isinstance(e, AgentStream)) == "Ask the tool."
    assert "".join(e.thinking_delta or "" for e in after if isinstance(e, AgentStream)) == (
        "The capital of France is Paris.")
    assert str(answer.response.content) == "Paris."


def test_a_model_that_does_not_think_streams_its_text_as_written(monkeypatch) -> None:
    responses = streamed(scripted(tiny_engine("llama"), monkeypatch, ANSWER), run_async=False)
    assert responses[-1].message.content == "".join(ANSWER)
    assert not any("thinking_delta" in r.additional_kwargs for r in responses)
