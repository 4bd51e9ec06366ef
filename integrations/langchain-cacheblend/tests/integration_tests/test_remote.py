"""ChatCacheBlend(base_url=...) against a real ``cacheblend-rag serve`` (the tiny random Qwen2, chunk K/V in
memory, started once for this module): what an app does in process works the same through the server, with
one argument changed. The stats and usage come from the server; retrieved chunks go to it as the request's
documents, warmed through its warm endpoint."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import create_retriever_tool, tool
from pydantic import BaseModel

from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend

PASSAGES = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Paris is the capital of France. The river Seine flows through Paris.",
]


class FixedRetriever(BaseRetriever):
    texts: list[str]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=t, metadata={"source": f"doc{i}"}) for i, t in enumerate(self.texts)]


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"20 C in {city}"


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server(cacheblend_server):
    return cacheblend_server


def remote(server, **kwargs: Any) -> ChatCacheBlend:
    return ChatCacheBlend(**{"base_url": server.base_url, "api_key": server.api_key, "max_tokens": 6,
                             "temperature": 0, **kwargs})


def ask(question: str, documents: list[Document] | list[str]) -> list[BaseMessage]:
    # The question first: a later call with the same documents then opens differently, so its chunks are read from
    # the server's store (cache_hits) instead of coming whole from its prefix cache.
    texts = [d.page_content if isinstance(d, Document) else d for d in documents]
    return [HumanMessage(f"{question}\n\nContext:\n" + "\n\n".join(texts))]


def test_retrieved_chunks_are_blended_and_read_from_the_store_again(server) -> None:
    llm = remote(server)
    retriever = CacheBlendRetriever(retriever=FixedRetriever(texts=PASSAGES[:2]), llm=llm)
    documents = retriever.invoke("Nobel prizes")  # warmed on the server, announced here
    first = llm.invoke(ask("Who won two Nobel prizes?", documents))
    meta = first.response_metadata
    assert meta["model_name"] == "tiny-qwen2" and meta["model_provider"] == "cacheblend"
    assert meta["cacheblend"]["mode"] == "blend" and meta["cacheblend"]["chunks_found"] == 2
    counter = TokenCounter()
    chunks = list(llm.stream(ask("Where does the Amazon flow?", documents), config={"callbacks": [counter]}))
    whole = sum(chunks[1:], chunks[0])
    stats = whole.response_metadata["cacheblend"]
    assert stats["chunks_found"] == 2 and stats["cache_hits"] == 2 and stats["cache_misses"] == 0
    usage = whole.usage_metadata
    assert usage["input_token_details"]["cache_read"] > 0 and usage["input_tokens"] == stats["prompt_tokens"]
    assert 0 < usage["output_tokens"] <= 6 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert chunks[-1].chunk_position == "last" and sum(1 for c in chunks if c.usage_metadata) == 1
    assert len(counter.tokens) == len(chunks)
    assert whole.response_metadata["finish_reason"] in ("stop", "length")


def test_chunks_computed_for_the_call_are_no_cache_read(server) -> None:
    llm = remote(server)
    llm.announce_chunks([PASSAGES[2]])  # announced, never warmed: the server computes it for this call
    message = llm.invoke(ask("What is the capital of France?", [PASSAGES[2]]))
    stats = message.response_metadata["cacheblend"]
    assert stats["chunks_found"] == 1 and stats["cache_misses"] == 1
    assert message.usage_metadata["input_token_details"]["cache_read"] < stats["reused_tokens"]


def test_a_required_tool_call_comes_back_as_tool_calls(server) -> None:
    llm = remote(server, max_tokens=100).bind_tools([get_weather], tool_choice="any")
    message = llm.invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"] and message.tool_calls[0]["id"]
    assert isinstance(message.tool_calls[0]["args"]["city"], str)


def test_structured_output_parses(server) -> None:
    llm = remote(server, max_tokens=100)
    assert isinstance(llm.with_structured_output(Person, method="json_schema").invoke("Who is Ada, 36?"), Person)
    assert isinstance(llm.with_structured_output(Person).invoke("Who is Ada, 36?"), Person)  # function_calling


async def test_async_calls(server) -> None:
    llm = remote(server, max_tokens=4)
    message = await llm.ainvoke("Hello")
    assert message.usage_metadata["output_tokens"] > 0 and "cacheblend" in message.response_metadata
    chunks = [c async for c in llm.astream("Hello again")]
    assert chunks[-1].usage_metadata["output_tokens"] > 0
    both = await asyncio.gather(llm.ainvoke("One"), llm.ainvoke("Two"))
    assert all(m.response_metadata["cacheblend"]["prompt_tokens"] > 0 for m in both)


def test_batch(server) -> None:
    answers = remote(server, max_tokens=2).batch(["One", "Two", "Three"])
    assert [a.usage_metadata["output_tokens"] for a in answers] == [2, 2, 2]


def test_warm_goes_to_the_servers_store(server) -> None:
    retriever = CacheBlendRetriever(retriever=FixedRetriever(texts=PASSAGES), llm=remote(server))
    texts = [f"{p} (warmed)" for p in PASSAGES]
    first = retriever.warm(texts, show_progress=False)
    assert (first.new, first.present) == (3, 0)
    assert (retriever.warm(texts, show_progress=False).present) == 3
    assert set(texts) <= set(retriever.llm.known_chunk_texts)


def test_an_agents_tool_results_are_blended(server) -> None:
    llm = remote(server)
    search = create_retriever_tool(FixedRetriever(texts=PASSAGES), "search", "Search.",
                                   response_format="content_and_artifact")
    call = {"name": "search", "args": {"query": "Nobel prizes"}, "id": "call_1", "type": "tool_call"}
    messages = [HumanMessage("Who won two Nobel prizes?"), AIMessage("", tool_calls=[call]), search.invoke(call)]
    answer = llm.bind_tools([search]).invoke(messages)  # the documents only ever were in the ToolMessage
    assert answer.response_metadata["cacheblend"]["chunks_found"] == len(PASSAGES)


def test_the_servers_key_is_needed(server, monkeypatch) -> None:
    monkeypatch.delenv("CACHEBLEND_API_KEY", raising=False)
    with pytest.raises(PermissionError, match="401"):
        remote(server, api_key="not-the-key").invoke("Hello")
    with pytest.raises(PermissionError, match="api_key"):
        ChatCacheBlend(base_url=server.base_url).invoke("Hello")
    monkeypatch.setenv("CACHEBLEND_API_KEY", server.api_key)
    assert ChatCacheBlend(base_url=server.base_url, max_tokens=1).invoke("Hello").usage_metadata["output_tokens"] == 1
