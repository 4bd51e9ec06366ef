"""Tools in the model's own format through CacheBlendLLM: a Qwen2.5-style template's parallel <tool_call>
blocks become several ToolSelections (one kept with allow_parallel_tool_calls=False), FunctionAgent runs
both calls and answers from their results, the ids of calls and results go into the template, and SmolLM2,
whose template cannot list tools, gets our format. Tiny models' random text is replaced by scripted answers
(cacheblend_rag.testing.script_answers); the requests themselves run."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.tools import FunctionTool

from cacheblend_rag.serving.tool_formats import CACHEBLEND, tool_format
from cacheblend_rag.testing import script_answers
from cacheblend_rag.testing_tools import tiny_tool_engine
from llama_index.llms.cacheblend import CacheBlendLLM

TWO_CALLS = ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n",
             "<tool_call>\n{\"name\": \"to_fahrenheit\", ", "\"arguments\": {\"celsius\": 20}}\n</tool_call>"]
ANSWER = ["It is 68.0", " F in Paris."]


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"20 C in {city}"


def to_fahrenheit(celsius: float) -> float:
    """Celsius to Fahrenheit."""
    return celsius * 9 / 5 + 32


TOOLS = [FunctionTool.from_defaults(get_weather), FunctionTool.from_defaults(to_fahrenheit)]


@pytest.fixture(scope="module")
def qwen_engine():
    return tiny_tool_engine("qwen2.5")


def scripted(engine, monkeypatch, *answers: list[str]) -> CacheBlendLLM:
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=3)
    script_answers(llm, monkeypatch, *answers)
    return llm


def last(responses):
    return list(responses)[-1]


def test_parallel_native_calls_are_several_tool_selections(qwen_engine, monkeypatch):
    llm = scripted(qwen_engine, monkeypatch, TWO_CALLS, TWO_CALLS)
    response = last(llm.stream_chat_with_tools(TOOLS, user_msg="How warm is Paris in F?", allow_parallel_tool_calls=True))
    selections = llm.get_tool_calls_from_response(response)
    assert [(s.tool_name, s.tool_kwargs) for s in selections] == [("get_weather", {"city": "Paris"}),
                                                                   ("to_fahrenheit", {"celsius": 20})]
    assert len({s.tool_id for s in selections}) == 2
    # chat_with_tools' default (allow_parallel_tool_calls=False) keeps the first, and the stats say so.
    response = last(llm.stream_chat_with_tools(TOOLS, user_msg="How warm is Paris in F?"))
    assert [s.tool_name for s in llm.get_tool_calls_from_response(response)] == ["get_weather"]
    assert response.additional_kwargs["dropped_tool_calls"] == 1


def test_function_agent_runs_parallel_native_calls_and_answers(qwen_engine, monkeypatch):
    llm = scripted(qwen_engine, monkeypatch, TWO_CALLS, ANSWER)
    agent = FunctionAgent(tools=TOOLS, llm=llm, allow_parallel_tool_calls=True)

    async def run():
        return await agent.run(user_msg="How warm is Paris in Fahrenheit?")

    result = asyncio.run(run())
    assert str(result.response.content) == "It is 68.0 F in Paris."
    assert [(c.tool_name, c.tool_output.content) for c in result.tool_calls] == [("get_weather", "20 C in Paris"),
                                                                                  ("to_fahrenheit", "68.0")]
    prompt = llm.last_prompt  # the answering call saw both calls and both results in Qwen's own format
    assert '<tool_call>\n{"name": "to_fahrenheit", "arguments": {"celsius": 20}}\n</tool_call>' in prompt
    assert "<tool_response>\n20 C in Paris\n</tool_response>\n<tool_response>\n68.0\n</tool_response>" in prompt


def test_a_round_trip_carries_the_ids_into_the_template(monkeypatch):
    llm = scripted(tiny_tool_engine("llama3.1", arch="llama"), monkeypatch, ANSWER)
    history = [
        ChatMessage(role="user", content="How warm is Paris in Fahrenheit?"),
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
            {"id": "call_a1", "name": "get_weather", "arguments": {"city": "Paris"}}]}),
        ChatMessage(role="tool", content="20 C in Paris", additional_kwargs={"tool_call_id": "call_a1"}),
        # A call as an OpenAI-format history holds it (arguments as JSON text).
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
            {"id": "call_b2", "type": "function", "function": {"name": "to_fahrenheit", "arguments": '{"celsius": 20}'}}]}),
        ChatMessage(role="tool", content="68.0", additional_kwargs={"tool_call_id": "call_b2"}),
    ]
    last(llm.stream_chat_with_tools(TOOLS, chat_history=history))
    assert '{"name": "to_fahrenheit", "parameters": {"celsius": 20}}' in llm.last_prompt
    assert "[call_a1] 20 C in Paris" in llm.last_prompt and "[call_b2] 68.0" in llm.last_prompt


def test_smollm2_gets_our_format_and_calls_through_it():
    llm = CacheBlendLLM(max_new_tokens=40, temperature=0)
    assert tool_format(llm.engine.tokenizer) is CACHEBLEND
    response = llm.chat_with_tools(TOOLS[:1], user_msg="What is the weather in Paris?", tool_required=True)
    assert [s.tool_name for s in llm.get_tool_calls_from_response(response)] == ["get_weather"]
    assert "You can use these tools:" in llm.last_prompt
