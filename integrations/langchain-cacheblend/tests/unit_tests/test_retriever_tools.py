"""Agentic RAG in LangChain: documents a retriever tool returns arrive in a ToolMessage and are blended
there, in the agent's answering call (question, tool call, tool result, answer), on a tiny random Llama."""

from __future__ import annotations

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.prompts import PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import BaseTool, create_retriever_tool

from cacheblend_rag.testing import tiny_engine
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend, cacheblend_retriever_tool
from langchain_cacheblend.tools import tool_result_documents

PASSAGES = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Paris is the capital of France. The river Seine flows through Paris.",
]
QUESTION = "Who won two Nobel prizes?"


class FixedRetriever(BaseRetriever):
    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=p, metadata={"source": f"doc{i}"}) for i, p in enumerate(PASSAGES)]


@pytest.fixture
def engine():
    # One per test: the prefix cache is the engine's, and a conversation asked again would come from it.
    return tiny_engine("llama")


def _llm(engine, **kwargs) -> ChatCacheBlend:
    return ChatCacheBlend(engine=engine, max_tokens=6, temperature=0, **kwargs)


def agent_loop(llm: ChatCacheBlend, tool: BaseTool, **call_options) -> tuple[AIMessage, list[BaseMessage]]:
    """Question, the model's first call (it fills the prefix cache), the tool's call and result, the answer."""
    bound = llm.bind_tools([tool], **call_options)
    question = [HumanMessage(QUESTION)]
    bound.invoke(question)
    call = {"name": tool.name, "args": {"query": "Nobel prizes"}, "id": "call_1", "type": "tool_call"}
    messages = [*question, AIMessage("", tool_calls=[call]), tool.invoke(call)]
    return bound.invoke(messages), messages


def passage_tokens(llm: ChatCacheBlend) -> int:
    return sum(len(llm.get_token_ids(p)) for p in PASSAGES)


def assert_passages_blended(llm: ChatCacheBlend, stats: dict) -> None:
    """Every passage's tokens came with chunk KV (not the prefix cache, not computed fresh) and the
    earlier turns came from the prefix cache."""
    assert stats["mode"] == "blend" and stats["chunks_found"] == len(PASSAGES), stats
    assert stats["prefix_tokens"] > 0  # the system turn and the question: the first call's prompt
    assert stats["cached_tokens"] - stats["prefix_tokens"] == passage_tokens(llm)
    assert stats["recomputed_tokens"] < passage_tokens(llm) / 2


def test_a_retriever_tool_over_cacheblend_retriever_blends_its_documents(engine) -> None:
    llm = _llm(engine)
    tool = create_retriever_tool(CacheBlendRetriever(retriever=FixedRetriever(), llm=llm), "search", "Search.")
    answer, _ = agent_loop(llm, tool)
    stats = answer.response_metadata["cacheblend"]
    assert_passages_blended(llm, stats)
    assert stats["precomputed_for_request"] == len(PASSAGES)  # the retriever computed them when the tool ran


def test_documents_in_a_tool_messages_artifact_are_blended_without_the_wrapper(engine) -> None:
    llm = _llm(engine)
    tool = create_retriever_tool(FixedRetriever(), "search", "Search.", response_format="content_and_artifact")
    answer, messages = agent_loop(llm, tool)
    assert [d.page_content for d in tool_result_documents(messages)] == PASSAGES
    stats = answer.response_metadata["cacheblend"]
    assert_passages_blended(llm, stats)
    assert stats["precomputed_for_request"] == len(PASSAGES)  # the chat model computed them for this call


def test_metadata_lines_and_separators_around_documents_stay_fresh(engine) -> None:
    llm = _llm(engine)
    prompt = PromptTemplate.from_template("Source: {source}\n{page_content}")
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, "search", "Search.", document_prompt=prompt,
                                     document_separator="\n---\n")
    answer, messages = agent_loop(llm, tool)
    assert messages[-1].content.startswith("Source: doc0\n" + PASSAGES[0] + "\n---\nSource: doc1")
    assert_passages_blended(llm, answer.response_metadata["cacheblend"])


@pytest.mark.parametrize("style", ["qwen2.5", "llama3.1"])
def test_documents_are_blended_inside_a_native_templates_tool_turn(style: str) -> None:
    # Qwen2.5 wraps a tool result in <tool_response> inside a user turn, Llama 3.1 writes it in an
    # ipython turn after the call's id: the documents stay verbatim, the wrapper is fresh text.
    from cacheblend_rag.testing_tools import tiny_tool_engine

    llm = _llm(tiny_tool_engine(style))
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, "search", "Search.")
    answer, _ = agent_loop(llm, tool)
    assert_passages_blended(llm, answer.response_metadata["cacheblend"])


def test_a_corpus_warmed_up_front_is_read_from_the_store(engine) -> None:
    llm = _llm(engine)
    llm.warm(PASSAGES, show_progress=False)
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, "search", "Search.", k=2)
    answer, messages = agent_loop(llm, tool)
    stats = answer.response_metadata["cacheblend"]
    assert [d.page_content for d in messages[-1].artifact] == PASSAGES[:2]
    assert (stats["chunks_found"], stats["cache_hits"], stats["precomputed_for_request"]) == (2, 2, 0)


def test_ratio_one_answers_as_full_prefill(engine) -> None:
    tool = create_retriever_tool(FixedRetriever(), "search", "Search.", response_format="content_and_artifact")
    blended, _ = agent_loop(_llm(engine, recompute_ratio=1.0), tool)
    plain, _ = agent_loop(_llm(tiny_engine("llama"), reuse_chunk_kv=False), tool)  # the same weights
    assert blended.response_metadata["cacheblend"]["chunks_found"] == len(PASSAGES)
    assert plain.response_metadata["cacheblend"]["mode"] != "blend"
    assert blended.content == plain.content


def test_with_reuse_off_tool_results_are_not_warmed(engine) -> None:
    llm = _llm(engine, reuse_chunk_kv=False)
    tool = create_retriever_tool(FixedRetriever(), "search", "Search.", response_format="content_and_artifact")
    agent_loop(llm, tool)
    assert llm.known_chunk_texts == []


def test_bad_arguments_say_what_to_pass(engine) -> None:
    llm = _llm(engine)
    with pytest.raises(ValueError, match=r"page_content"):
        cacheblend_retriever_tool(FixedRetriever(), llm, "search", "Search.",
                                  document_prompt=PromptTemplate.from_template("Source: {source}"))
    other = CacheBlendRetriever(retriever=FixedRetriever(), llm=_llm(engine))
    with pytest.raises(ValueError, match="another ChatCacheBlend"):
        cacheblend_retriever_tool(other, llm, "search", "Search.")
    with pytest.raises(TypeError, match="ChatCacheBlend"):
        cacheblend_retriever_tool(FixedRetriever(), object(), "search", "Search.")  # type: ignore[arg-type]
