"""Streaming with tools bound: text streams token by token as soon as it cannot be a call, a call
is read whole at the end (cacheblend_rag.serving.tool_stream, tested in test_tool_stream.py), in both
integrations, sync and async, and in the agents built on them. Scripted answers stand in for a model
that calls a tool on demand."""

from __future__ import annotations

import asyncio
import typing
from typing import Any, Literal

import pytest
from langchain_cacheblend import ChatCacheBlend
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.cacheblend import CacheBlendLLM

from cacheblend_rag.testing import script_answers, tiny_engine

STORY = ["Once", " upon", " a", " time", ", a", " fox", " slept", "."]
CALL = ["{\"", "name", "\": \"", "set_mode", "\", \"arguments\": {\"mode\": \"", "safe", "\"}}"]


def set_mode(mode: Literal["fast", "safe"]) -> str:
    """Switch the pipeline's mode."""
    return f"mode set to {mode}"


set_mode.__annotations__ = typing.get_type_hints(set_mode)  # resolved: LlamaIndex reads them as they are


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


script = script_answers  # Make ``llm`` answer its next calls with the given answers, in order.


# ------------------------------------------------------------------ LlamaIndex
def test_llamaindex_sync_stream_chat_with_tools_is_a_generator(engine):
    """It was ``iter([...])``, which LlamaIndex's callback decorator does not wrap: a ValidationError."""
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=8)
    tool = FunctionTool.from_defaults(fn=set_mode)
    responses = list(llm.stream_chat_with_tools([tool], user_msg="Switch to the safe mode."))
    assert responses and "mode" in responses[-1].additional_kwargs  # the stats ride on the last one


def test_llamaindex_streams_text_and_ends_with_the_call(engine, monkeypatch):
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=8)
    tool = FunctionTool.from_defaults(fn=set_mode)
    script(llm, monkeypatch, STORY, CALL, STORY)
    story = list(llm.stream_chat_with_tools([tool], user_msg="Tell me a short story."))
    assert len(story) > 1 and "".join(r.delta for r in story) == story[-1].message.content == "".join(STORY)
    assert llm.get_tool_calls_from_response(story[-1], error_on_no_tool_call=False) == []

    call = list(llm.stream_chat_with_tools([tool], user_msg="Switch to the safe mode."))
    (selection,) = llm.get_tool_calls_from_response(call[-1])
    assert selection.tool_name == "set_mode" and selection.tool_kwargs == {"mode": "safe"}

    async def astream() -> list:
        return [r async for r in await llm.astream_chat_with_tools([tool], user_msg="Tell me a short story.")]

    responses = asyncio.run(astream())
    assert len(responses) > 1 and responses[-1].message.content == "".join(STORY)


def test_llamaindex_function_agent_calls_the_tool_then_streams_its_answer(engine, monkeypatch):
    from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCallResult

    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=8)
    script(llm, monkeypatch, CALL, STORY)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=set_mode)], llm=llm)

    async def run() -> tuple[list, Any]:
        handler = agent.run(user_msg="Switch to the safe mode, then tell me a short story.")
        events = [e async for e in handler.stream_events() if isinstance(e, (AgentStream, ToolCallResult))]
        return events, await handler

    events, answer = asyncio.run(run())
    (result,) = [e for e in events if isinstance(e, ToolCallResult)]
    assert result.tool_name == "set_mode" and result.tool_output.content == "mode set to safe"
    after = events[events.index(result):]
    assert len([e for e in after if isinstance(e, AgentStream) and e.delta]) > 1
    assert str(answer.response.content) == "".join(STORY)


@pytest.mark.slow
def test_llamaindex_function_agent_streams_token_by_token(smollm2_engine):
    from llama_index.core.agent.workflow import AgentStream, FunctionAgent

    llm = CacheBlendLLM.from_engine(smollm2_engine, max_new_tokens=24, temperature=0.0)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=set_mode)], llm=llm)

    async def run() -> list[AgentStream]:
        handler = agent.run(user_msg="Tell me a short story.")
        events = [e async for e in handler.stream_events() if isinstance(e, AgentStream)]
        await handler
        return events

    events = asyncio.run(run())
    assert len([e for e in events if e.delta]) > 1


# ------------------------------------------------------------------ LangChain
@pytest.mark.slow
def test_langchain_bound_tools_stream_a_real_answer_token_by_token(smollm2_engine):
    bound = ChatCacheBlend(engine=smollm2_engine, max_tokens=24, temperature=0.0).bind_tools([set_mode])
    chunks = [c for c in bound.stream("Tell me a short story.") if c.content]
    assert len(chunks) > 1


def test_langchain_streams_text_and_ends_with_the_call(engine, monkeypatch):
    llm = ChatCacheBlend(engine=engine, max_tokens=8)
    bound = llm.bind_tools([set_mode])
    script(llm, monkeypatch, STORY, CALL, STORY)
    chunks = list(bound.stream("Tell me a short story."))
    texts = [c.content for c in chunks if c.content]
    assert len(texts) > 1 and "".join(texts) == "".join(STORY)
    assert not sum(chunks[1:], chunks[0]).tool_calls

    message = sum(bound.stream("Switch to the safe mode."), AIMessageChunk(content=""))
    assert message.content == "" and message.tool_calls[0]["name"] == "set_mode"
    assert message.tool_calls[0]["args"] == {"mode": "safe"}

    async def astream() -> list:
        return [c async for c in bound.astream("Tell me a short story.")]

    assert len([c for c in asyncio.run(astream()) if c.content]) > 1


def test_langchain_tool_calling_agent_streams(engine, monkeypatch):
    """An agent loop (bind_tools, stream, run the calls, answer): the call is run, the answer streams."""
    llm = ChatCacheBlend(engine=engine, max_tokens=8)
    bound = llm.bind_tools([set_mode])
    script(llm, monkeypatch, CALL, STORY)
    messages: list = [HumanMessage("Switch to the safe mode, then tell me a short story.")]
    streamed_text: list[str] = []
    for _ in range(3):
        message = AIMessageChunk(content="")
        for chunk in bound.stream(messages):
            streamed_text += [chunk.content] if chunk.content else []
            message += chunk
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append(ToolMessage(set_mode(**call["args"]), tool_call_id=call["id"]))
    assert isinstance(messages[2], ToolMessage) and messages[2].content == "mode set to safe"
    assert len(streamed_text) > 1 and messages[-1].content == "".join(STORY)
