"""ChatCacheBlend(base_url=...) without a server: nothing is loaded here, the key stays secret, what needs a local
model says so, and a call's turn (messages, documents, tools, options) goes to the server's client as it should,
its events coming back as LangChain's chunks. The server itself: tests/integration_tests/test_remote.py."""

from __future__ import annotations

import json
import socket
from typing import Any, Iterator

import pytest
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.load import dumpd, dumps
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from cacheblend_rag.serving import (ChatTurn, ConfigError, ReasoningDelta, RemoteChat, TextDelta, ToolCall, ToolCalls,
                                    TurnEnd)
from langchain_cacheblend import ChatCacheBlend

CHUNK = "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris."
OTHER = "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean."
SERVED = {"id": "tiny-qwen2", "max_model_len": 2048}


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


class Person(BaseModel):
    name: str


@pytest.fixture
def base_url() -> str:
    """The URL of a port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


class FakeServer:
    """Stands in for the server's client: records each turn, answers with the events it was given."""

    def __init__(self, llm: ChatCacheBlend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.turns: list[ChatTurn] = []
        self.blend_options: list[dict[str, Any]] = []
        self.answer: list[Any] = [TextDelta("Hel"), TextDelta("lo"), TurnEnd("stop", 12, 2, 5, {"mode": "blend"})]
        monkeypatch.setattr(llm.remote, "run_turn", self.run_turn)
        monkeypatch.setattr(llm.remote, "model_info", lambda: SERVED)

    def run_turn(self, turn: ChatTurn, blend_options: dict[str, Any] | None = None) -> Iterator[Any]:
        self.turns.append(turn)
        self.blend_options.append(dict(blend_options or {}))
        yield from self.answer


def test_nothing_is_loaded_and_what_needs_the_model_says_so(base_url) -> None:
    llm = ChatCacheBlend(base_url=base_url, max_tokens=8)
    assert llm.is_remote and llm.engine is None and llm.chunk_cache is None
    assert llm.profile is None  # the server could not be asked; LangChain leaves it unset
    with pytest.raises(ConfigError, match="server at http://127.0.0.1"):
        llm.get_engine()
    with pytest.raises(NotImplementedError, match="custom_get_token_ids"):
        llm.get_num_tokens("hello")
    with pytest.raises(NotImplementedError, match="custom_get_token_ids"):
        llm.get_num_tokens_from_messages([HumanMessage("hello")])
    with pytest.raises(ConnectionError, match="cacheblend-rag serve"):
        llm.invoke("Hello")
    counted = ChatCacheBlend(base_url=base_url, custom_get_token_ids=lambda text: [0] * len(text))
    assert counted.get_num_tokens("hello") == 5
    assert counted.get_num_tokens_from_messages([HumanMessage("hello")]) > 5  # the role's text counts too


def test_the_profile_is_the_servers_model(base_url, monkeypatch) -> None:
    monkeypatch.setattr(RemoteChat, "model_info", lambda self: SERVED)
    profile = ChatCacheBlend(base_url=base_url).profile
    assert profile["name"] == "tiny-qwen2" and profile["max_input_tokens"] == 2048
    assert profile["tool_calling"] and profile["structured_output"] and "reasoning_output" not in profile


def test_the_api_key_is_a_secret(base_url) -> None:
    llm = ChatCacheBlend(base_url=base_url, api_key="sk-very-secret", max_retries=3)
    assert llm.lc_secrets["api_key"] == "CACHEBLEND_API_KEY"
    for shown in (repr(llm), str(llm), dumps(llm), json.dumps(llm._identifying_params), str(llm.model_dump()),
                  str(llm._get_ls_params())):
        assert "sk-very-secret" not in shown
    assert dumpd(llm)["kwargs"]["api_key"] == {"lc": 1, "type": "secret", "id": ["CACHEBLEND_API_KEY"]}
    assert llm._identifying_params["base_url"] == base_url
    assert llm.api_key.get_secret_value() == "sk-very-secret"  # what the client sends


def test_events_become_chunks(base_url, monkeypatch) -> None:
    llm = ChatCacheBlend(base_url=base_url, max_tokens=8)
    server = FakeServer(llm, monkeypatch)
    server.answer = [ReasoningDelta("Think."), TextDelta("Hi"),
                     ToolCalls([ToolCall("weather", {"city": "Paris"}, "call_1")]),
                     TurnEnd("stop", 12, 4, 5, {"mode": "blend", "cache_hits": 1})]
    chunks = list(llm.stream("Hello"))
    assert chunks[0].additional_kwargs == {"reasoning_content": "Think."} and chunks[1].content == "Hi"
    whole = sum(chunks[1:], chunks[0])
    assert whole.tool_calls == [{"name": "weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}]
    assert whole.usage_metadata == {"input_tokens": 12, "output_tokens": 4, "total_tokens": 16,
                                    "input_token_details": {"cache_read": 5}}
    assert whole.response_metadata["cacheblend"] == {"mode": "blend", "cache_hits": 1}
    assert whole.response_metadata["model_name"] == "tiny-qwen2"  # the server's, no model given
    message = llm.invoke("Hello")
    assert message.response_metadata["finish_reason"] == "stop" and message.content == "Hi"


def test_the_turn_carries_the_call(base_url, monkeypatch) -> None:
    llm = ChatCacheBlend(base_url=base_url, max_tokens=8, recompute_ratio=0.3, timeout=9.0,
                         chat_template_kwargs={"enable_thinking": False})
    server = FakeServer(llm, monkeypatch)
    llm.bind(max_tokens=3, temperature=0.5, profile_layers=2).invoke([SystemMessage("Be brief."), HumanMessage("Hi")],
                                                                      stop=["\n"])
    turn = server.turns[-1]
    assert turn.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert turn.generation.max_new_tokens == 3 and turn.generation.temperature == 0.5
    assert turn.generation.stop == ("\n",) and turn.timeout == 9.0
    assert turn.blend_options == {"profile_layers": 2} and server.blend_options[-1] == {"recompute_ratio": 0.3}
    assert turn.template_kwargs == {"enable_thinking": False} and turn.documents == []
    llm.bind_tools([weather], tool_choice="any", parallel_tool_calls=False).invoke("Weather in Paris?")
    turn = server.turns[-1]
    assert [t["function"]["name"] for t in turn.tools] == ["weather"]
    assert turn.tool_choice == "any" and turn.parallel_tool_calls is False
    server.answer = [TextDelta('{"name": "Ada"}'), TurnEnd("stop", 5, 4, 0, {})]
    assert llm.with_structured_output(Person, method="json_schema").invoke("Who?") == Person(name="Ada")
    assert server.turns[-1].response_format["properties"]["name"]["type"] == "string"


def test_announced_chunks_and_tool_results_go_as_documents(base_url, monkeypatch) -> None:
    llm = ChatCacheBlend(base_url=base_url, max_tokens=8)
    server = FakeServer(llm, monkeypatch)
    llm.announce_chunks([CHUNK, OTHER])
    llm.invoke([SystemMessage(f"Context:\n{CHUNK}"), HumanMessage("Who won two Nobel prizes?")])
    assert server.turns[-1].documents == [CHUNK]  # the announced texts found in the messages
    # A retriever tool's documents in a ToolMessage's artifact: announced, so they are sent though nobody warmed them.
    llm.forget_chunks()
    call = {"name": "search", "args": {"query": "Amazon"}, "id": "call_1", "type": "tool_call"}
    result = ToolMessage(f"Source: doc1\n{OTHER}", tool_call_id="call_1", artifact=[Document(page_content=OTHER)])
    llm.bind_tools([weather]).invoke([HumanMessage("Where does the Amazon flow?"), AIMessage("", tool_calls=[call]),
                                      result])
    assert server.turns[-1].documents == [OTHER] and llm.known_chunk_texts == [OTHER]
    off = ChatCacheBlend(base_url=base_url, reuse_chunk_kv=False)
    FakeServer(off, monkeypatch)
    off.invoke([HumanMessage("Where?"), AIMessage("", tool_calls=[call]), result])
    assert off.known_chunk_texts == []


def test_batch_keeps_eight_calls_in_flight(base_url, monkeypatch) -> None:
    llm = ChatCacheBlend(base_url=base_url)
    seen: list[Any] = []

    def batch(self, inputs, config=None, **kwargs):
        seen.append(config)
        return []

    monkeypatch.setattr(BaseChatModel, "batch", batch, raising=False)
    llm.batch(["a"] * 20)
    llm.batch(["a"] * 3)
    llm.batch(["a"] * 20, config={"max_concurrency": 2})
    assert [{c["max_concurrency"] for c in configs} for configs in seen] == [{8}, {3}, {2}]
