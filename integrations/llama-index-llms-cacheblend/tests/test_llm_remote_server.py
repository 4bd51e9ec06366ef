"""CacheBlendLLM(base_url=...) against a real ``cacheblend-rag serve`` (a tiny random Qwen2, chunk K/V in
memory), started once for the module in a thread of this process on a free port: complete, chat and their streaming and
async forms with the server's stats, token usage as TokenCountingHandler reads it, tools and structured output,
the model's metadata, a key kept out of every dump, and a wrong key refused. Nothing is loaded here."""

from __future__ import annotations

import asyncio
import json
import pickle
from typing import Iterator

import pytest
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from llama_index.llms.cacheblend import CacheBlendLLM

KEY = "test-key-not-a-secret"
QUESTION = [ChatMessage(role="user", content="What is the capital of France?")]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The server's app of the tiny Qwen2 (chunk K/V in memory) taking KEY, in a thread of this process."""
    pytest.importorskip("uvicorn", reason="`cacheblend-rag serve` needs the [server] extra")
    from cacheblend_rag.server.testing import running_server

    with running_server("tiny-qwen2", api_key=KEY) as running:
        yield running.url


@pytest.fixture
def llm(server: str) -> CacheBlendLLM:
    return CacheBlendLLM(base_url=server, api_key=KEY, max_new_tokens=6)


def test_complete_chat_and_streams_carry_the_servers_stats(llm: CacheBlendLLM) -> None:
    assert llm.engine is None and llm.is_remote  # nothing loaded here
    completion = llm.complete("Name the capital of France.")
    assert completion.text and completion.additional_kwargs["prompt_tokens"] > 0
    assert completion.raw["usage"]["completion_tokens"] > 0
    assert "cached_tokens" in completion.raw["usage"]["prompt_tokens_details"]
    assert llm.last_stats == completion.additional_kwargs["cacheblend"] and llm.last_prompt == "Name the capital of France."

    chat = llm.chat(QUESTION)
    assert chat.message.role == "assistant" and chat.additional_kwargs["mode"]
    streamed = list(llm.stream_chat(QUESTION))
    assert "".join(r.delta or "" for r in streamed) == streamed[-1].message.content
    assert streamed[-1].additional_kwargs["prompt_tokens"] == chat.additional_kwargs["prompt_tokens"]
    assert not any("prompt_tokens" in r.additional_kwargs for r in streamed[:-1])  # stats on the last only
    # The same conversation again: its opening comes from the server's prefix cache.
    assert streamed[-1].raw["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    pieces = list(llm.stream_complete("Name the capital of France."))
    assert "".join(p.delta for p in pieces) == pieces[-1].text and pieces[-1].additional_kwargs["mode"]


def test_async_forms(llm: CacheBlendLLM) -> None:
    async def run():
        achat = await llm.achat(QUESTION)
        pieces = [r async for r in await llm.astream_chat(QUESTION)]
        acomplete = await llm.acomplete("Name the capital of France.")
        return achat, pieces, acomplete

    achat, pieces, acomplete = asyncio.run(run())
    assert achat.additional_kwargs["prompt_tokens"] > 0 and acomplete.additional_kwargs["prompt_tokens"] > 0
    assert "".join(r.delta or "" for r in pieces) == pieces[-1].message.content
    assert pieces[-1].additional_kwargs["mode"] and pieces[-1].raw["usage"]["total_tokens"] > 0


def test_callbacks_count_the_servers_tokens(server: str) -> None:
    counter = TokenCountingHandler(tokenizer=lambda text: text.split())  # used only where no usage came back
    llm = CacheBlendLLM(base_url=server, api_key=KEY, max_new_tokens=4, callback_manager=CallbackManager([counter]))
    response = llm.chat(QUESTION)
    assert counter.prompt_llm_token_count == response.raw["usage"]["prompt_tokens"]
    assert counter.completion_llm_token_count == response.raw["usage"]["completion_tokens"]


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"20 C in {city}"


class Capital(BaseModel):
    country: str
    city: str


def test_a_required_tool_call_and_structured_output(server: str) -> None:
    llm = CacheBlendLLM(base_url=server, api_key=KEY, max_new_tokens=64, temperature=0)  # room for a whole call
    tool = FunctionTool.from_defaults(get_weather)
    response = llm.chat_with_tools([tool], user_msg="What is the weather in Paris?", tool_required=True)
    (selection,) = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "get_weather" and set(selection.tool_kwargs) == {"city"}
    assert response.additional_kwargs["prompt_tokens"] > 0

    async def stream():
        return [r async for r in await llm.astream_chat_with_tools([tool], chat_history=QUESTION, tool_required=True)]

    streamed = asyncio.run(stream())
    assert llm.get_tool_calls_from_response(streamed[-1])[0].tool_name == "get_weather"
    # structured_predict goes through a required call of the output's schema (a function-calling LLM).
    capital = llm.structured_predict(Capital, PromptTemplate("Name the capital of {country}."), country="France")
    assert isinstance(capital, Capital)
    structured = llm.as_structured_llm(Capital).chat([ChatMessage(role="user", content="The capital of France?")])
    assert isinstance(structured.raw, Capital)
    # response_format reaches the server, which holds the answer to JSON of that schema.
    answer = llm.complete("The capital of France, as JSON.", response_format=Capital.model_json_schema())
    assert set(json.loads(answer.text)) <= {"country", "city"}


def test_metadata_comes_from_the_server_and_the_key_stays_out(llm: CacheBlendLLM, server: str) -> None:
    meta = llm.metadata
    assert (meta.context_window, meta.model_name, meta.is_chat_model) == (4096, "tiny-qwen2", True)
    assert CacheBlendLLM(base_url=server, api_key=KEY, context_window=1000).metadata.context_window == 1000
    for dump in (repr(llm), str(llm), str(llm.to_dict()), llm.to_json(), llm.model_dump_json()):
        assert KEY not in dump
    assert "api_key" not in llm.to_dict() and llm.to_dict()["base_url"] == server
    assert llm.config_source == f"server: {server}"  # the server's setting, which each response names
    with pytest.raises(ValueError, match=r"tokenizer_fn .* answers through the server at .*AutoTokenizer"):
        _ = llm.tokenizer_fn
    # Pickled (IngestionPipeline's workers), it is a client of the same server, with its key.
    assert pickle.loads(pickle.dumps(llm)).complete("Hello").additional_kwargs["prompt_tokens"] > 0


def test_a_wrong_key_is_refused(server: str) -> None:
    with pytest.raises(PermissionError, match="api_key"):
        CacheBlendLLM(base_url=server, api_key="wrong", max_new_tokens=2).complete("Hello")
