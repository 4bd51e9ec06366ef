"""Tools in the model's own format through ChatCacheBlend: a Qwen2.5-style template's <tool_call> blocks and
a Llama-3.1-style template's JSON become AIMessage.tool_calls (several at once: parallel calls), the ids of
calls and results go into the template, a required call is constrained in the native format, and SmolLM2,
whose template cannot list tools, gets our format. Tiny models' random text is replaced by scripted answers
(cacheblend_rag.testing.script_answers); the requests themselves run."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from cacheblend_rag.serving.tool_formats import CACHEBLEND, HERMES, LLAMA3_JSON, tool_format
from cacheblend_rag.testing import script_answers
from cacheblend_rag.testing_tools import tiny_tool_engine
from langchain_cacheblend import ChatCacheBlend
from langchain_cacheblend._messages import render_prompt

TWO_CALLS = ["Checking.\n<tool_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n",
             "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"]


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"20 C in {city}"


@tool
def to_fahrenheit(celsius: float) -> float:
    """Celsius to Fahrenheit."""
    return celsius * 9 / 5 + 32


@pytest.fixture(scope="module")
def qwen_engine():
    return tiny_tool_engine("qwen2.5")


def scripted(engine, monkeypatch, *answers: list[str]) -> ChatCacheBlend:
    llm = ChatCacheBlend(engine=engine, max_tokens=3)
    script_answers(llm, monkeypatch, *answers)
    return llm


def test_parallel_native_calls_are_tool_calls_with_ids(qwen_engine, monkeypatch):
    llm = scripted(qwen_engine, monkeypatch, TWO_CALLS, TWO_CALLS).bind_tools([get_weather, to_fahrenheit])
    message = llm.invoke("Weather in Paris and Rome?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                    ("get_weather", {"city": "Rome"})]
    assert len({c["id"] for c in message.tool_calls}) == 2 and message.content == "Checking."
    chunks = list(llm.stream("Weather in Paris and Rome?"))
    assert chunks[0].content == "Checking."  # text before the call streams; the call's text never shows
    whole = sum(chunks[1:], chunks[0])
    assert [c["args"]["city"] for c in whole.tool_calls] == ["Paris", "Rome"]


def test_parallel_tool_calls_false_keeps_the_first(qwen_engine, monkeypatch):
    llm = scripted(qwen_engine, monkeypatch, TWO_CALLS).bind_tools([get_weather], parallel_tool_calls=False)
    message = llm.invoke("Weather in Paris and Rome?")
    assert [c["args"] for c in message.tool_calls] == [{"city": "Paris"}]
    assert message.response_metadata["cacheblend"]["dropped_tool_calls"] == 1


def test_a_malformed_call_in_auto_mode_is_text_with_a_flag(qwen_engine, monkeypatch):
    broken = ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\"}}\n</tool_call>"]
    message = scripted(qwen_engine, monkeypatch, broken).bind_tools([get_weather]).invoke("Weather?")
    assert message.tool_calls == [] and message.content == broken[0]
    assert "not JSON" in message.response_metadata["cacheblend"]["malformed_tool_call"]


def test_a_round_trip_carries_the_ids_into_the_template():
    engine = tiny_tool_engine("llama3.1", arch="llama")
    conversation = [
        HumanMessage("How warm is Paris in Fahrenheit?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_a1"}]),
        ToolMessage("20 C in Paris", tool_call_id="call_a1"),
        AIMessage("", tool_calls=[{"name": "to_fahrenheit", "args": {"celsius": 20}, "id": "call_b2"}]),
        ToolMessage("68.0", tool_call_id="call_b2"),
    ]
    functions = [{"name": "get_weather", "parameters": get_weather.args_schema.model_json_schema()}]
    prompt = render_prompt(engine.tokenizer, conversation, functions=functions)
    assert '{"name": "to_fahrenheit", "parameters": {"celsius": 20}}' in prompt
    assert "[call_a1] 20 C in Paris" in prompt and "[call_b2] 68.0" in prompt
    # The question, call and results count as the prompt a call renders (trim_messages' counter).
    llm = ChatCacheBlend(engine=engine)
    assert llm.get_num_tokens_from_messages(conversation, tools=[get_weather]) > llm.get_num_tokens_from_messages(conversation)


@pytest.mark.parametrize("style, arch, fmt", [("qwen2.5", "qwen2", HERMES), ("llama3.1", "llama", LLAMA3_JSON)])
def test_a_required_call_is_constrained_in_the_native_format(style, arch, fmt):
    engine = tiny_tool_engine(style, arch=arch)
    assert tool_format(engine.tokenizer) is fmt
    llm = ChatCacheBlend(engine=engine, max_tokens=100).bind_tools([to_fahrenheit], tool_choice="any")
    message = llm.invoke("What is 20 C in Fahrenheit?")  # the tiny model's own answer, held to a call
    assert [c["name"] for c in message.tool_calls] == ["to_fahrenheit"]
    assert isinstance(message.tool_calls[0]["args"]["celsius"], (int, float))


@pytest.mark.slow
def test_smollm2_gets_our_format_and_calls_through_it(smollm2_engine):
    assert tool_format(smollm2_engine.tokenizer) is CACHEBLEND
    llm = ChatCacheBlend(engine=smollm2_engine, max_tokens=40, temperature=0)
    message = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"] and message.tool_calls[0]["id"]
