"""Agentic RAG in LlamaIndex: nodes a RetrieverTool returns arrive in a tool message and are blended there,
in the agent's answering call (question, tool call, tool result, answer), on a tiny random Llama. The
messages are the ones FunctionAgent builds: the tool's output blocks in a "tool" message."""

from __future__ import annotations

import asyncio
from typing import List

import pytest
from llama_index.core.llms import ChatMessage
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.tools import QueryEngineTool, RetrieverTool
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendNodePostprocessor, cacheblend_retriever_tool

from cacheblend_rag.testing import tiny_engine

PASSAGES = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Paris is the capital of France. The river Seine flows through Paris.",
]
QUESTION = "Who won two Nobel prizes?"


class FixedRetriever(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=p, metadata={"source": f"doc{i}"}), score=1.0)
                for i, p in enumerate(PASSAGES)]


def _llm(**kwargs) -> CacheBlendLLM:
    # A fresh engine per LLM: the prefix cache is the engine's, and a conversation asked again would come from it.
    return CacheBlendLLM(engine=tiny_engine("llama"), **{"max_new_tokens": 6, "temperature": 0, **kwargs})


def _messages(tool: RetrieverTool, output) -> List[ChatMessage]:
    call = {"id": "call_1", "name": tool.metadata.name, "arguments": {"query": "Nobel prizes"}}
    return [ChatMessage(role="user", content=QUESTION),
            ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [call]}),
            ChatMessage(role="tool", blocks=output.blocks, additional_kwargs={"tool_call_id": "call_1"})]


def agent_loop(llm: CacheBlendLLM, tool: RetrieverTool):
    llm.chat_with_tools([tool], chat_history=[ChatMessage(role="user", content=QUESTION)])  # fills the prefix cache
    return llm.chat_with_tools([tool], chat_history=_messages(tool, tool.call(query="Nobel prizes")))


def assert_passages_blended(llm: CacheBlendLLM, stats: dict) -> None:
    """Every node's tokens (its metadata line included: the text RetrieverTool writes) came with chunk KV,
    and the earlier turns came from the prefix cache."""
    node_tokens = sum(len(llm.engine.tokenize(f"source: doc{i}\n\n{p}")) for i, p in enumerate(PASSAGES))
    assert stats["mode"] == "blend" and stats["chunks_found"] == len(PASSAGES), stats
    assert stats["prefix_tokens"] > 0
    assert stats["cached_tokens"] - stats["prefix_tokens"] == node_tokens
    assert stats["recomputed_tokens"] < node_tokens / 2


def test_retriever_tool_nodes_are_blended_in_the_answering_call() -> None:
    llm = _llm()
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, name="search", description="Search the documents.")
    stats = agent_loop(llm, tool).additional_kwargs
    assert_passages_blended(llm, stats)
    assert stats["precomputed_for_request"] == len(PASSAGES)


def test_a_function_agent_blends_the_nodes_in_its_answering_call() -> None:
    from llama_index.core.agent.workflow import FunctionAgent

    llm = _llm(max_new_tokens=48)  # room for the whole call
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, name="search", description="Search the documents.")
    # The first call is forced to be the tool's (a tiny random model would not choose it); the second answers.
    agent = FunctionAgent(tools=[tool], llm=llm, initial_tool_choice="search")

    async def run():  # the workflow starts its task on the running loop
        return await agent.run(user_msg=QUESTION)

    asyncio.run(run())
    assert llm.last_prompt.count("Marie Curie was a physicist") == 1  # the answering call's prompt holds the nodes
    assert_passages_blended(llm, llm.last_stats)


def test_async_tool_and_chat_blend_too() -> None:
    llm = _llm()
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, name="search", description="Search the documents.")

    async def run():
        await llm.achat_with_tools([tool], chat_history=[ChatMessage(role="user", content=QUESTION)])
        output = await tool.acall(query="Nobel prizes")
        return await llm.achat_with_tools([tool], chat_history=_messages(tool, output))

    assert_passages_blended(llm, asyncio.run(run()).additional_kwargs)


def test_a_corpus_warmed_up_front_is_read_from_the_store() -> None:
    llm = _llm()
    llm.precompute([f"source: doc{i}\n\n{p}" for i, p in enumerate(PASSAGES)])
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, name="search", description="Search the documents.")
    stats = agent_loop(llm, tool).additional_kwargs
    assert (stats["chunks_found"], stats["cache_hits"], stats["precomputed_for_request"]) == (3, 3, 0)


def test_ratio_one_answers_as_full_prefill() -> None:
    blended_llm, plain_llm = _llm(recompute_ratio=1.0), _llm(reuse_chunk_kv=False)
    blended = agent_loop(blended_llm, cacheblend_retriever_tool(FixedRetriever(), blended_llm, name="search"))
    plain = agent_loop(plain_llm, RetrieverTool.from_defaults(FixedRetriever(), name="search"))
    assert blended.additional_kwargs["chunks_found"] == len(PASSAGES)
    assert plain.additional_kwargs["mode"] != "blend"
    assert blended.raw["token_ids"] == plain.raw["token_ids"]


def test_a_query_engine_tool_blends_inside_its_query_engine() -> None:
    # QueryEngineTool's output is the query engine's answer, not the nodes: the chunks are blended in the
    # query engine's own call, by the postprocessor on it.
    llm = _llm()
    engine = RetrieverQueryEngine.from_args(FixedRetriever(), llm=llm,
                                            node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])
    tool = QueryEngineTool.from_defaults(engine, name="ask_docs", description="Answer from the documents.")
    tool.call(input=QUESTION)
    assert llm.last_stats["mode"] == "blend" and llm.last_stats["chunks_found"] == len(PASSAGES)


def test_bad_arguments_say_what_to_pass() -> None:
    llm = _llm()
    with pytest.raises(TypeError, match="CacheBlendLLM"):
        cacheblend_retriever_tool(FixedRetriever(), object(), name="search")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already holds a CacheBlendNodePostprocessor"):
        cacheblend_retriever_tool(FixedRetriever(), llm, name="search",
                                  node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])
