"""The retrieval side against a real ``cacheblend-rag serve`` (a tiny random Qwen2, chunk K/V in memory),
started once for the module in a thread of this process on a free port: CacheBlendLLM(base_url=...) in a query engine with
CacheBlendNodePostprocessor (the nodes warmed in the server's store, then sent as the request's documents),
CacheBlendKVPrecompute at ingestion, and a FunctionAgent over cacheblend_retriever_tool (agentic RAG)."""

from __future__ import annotations

import asyncio
from typing import Any, Iterator, List

import pytest
from llama_index.core import Document, PromptTemplate, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.llms import ChatMessage
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.llms.cacheblend import CacheBlendLLM
from test_postprocessor_cacheblend import HashEmbedding  # the package tests' offline embedding
from llama_index.postprocessor.cacheblend import (
    CacheBlendKVPrecompute,
    CacheBlendNodePostprocessor,
    cacheblend_retriever_tool,
)

KEY = "test-key-not-a-secret"
PASSAGES = [
    "Paris is the capital of France. The river Seine flows through Paris.",
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The server's app of the tiny Qwen2 (chunk K/V in memory) taking KEY, in a thread of this process."""
    pytest.importorskip("uvicorn", reason="`cacheblend-rag serve` needs the [server] extra")
    from cacheblend_rag.server.testing import running_server

    with running_server("tiny-qwen2", api_key=KEY) as running:
        yield running.url


def test_a_query_engine_blends_the_nodes_in_the_server(server: str) -> None:
    llm = CacheBlendLLM(base_url=server, api_key=KEY, max_new_tokens=4)
    index = VectorStoreIndex.from_documents([Document(text=p, metadata={"n": str(i)}) for i, p in enumerate(PASSAGES)],
                                            embed_model=HashEmbedding())
    # The question before the context, so that a second question's nodes come from the store, not from the
    # prefix cache (which holds the whole of a prompt asked before).
    template = PromptTemplate("Question: {query_str}\nContext:\n{context_str}\nAnswer:")
    engine = index.as_query_engine(llm=llm, similarity_top_k=3, text_qa_template=template,
                                   node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])
    engine.query("What is the capital of France?")
    first = llm.last_stats  # the postprocessor warmed the nodes in the server's store and sent them as documents
    assert first["mode"] == "blend" and first["chunks_found"] == 3 and first["cache_hits"] == 3, first
    response = engine.query("Which river flows through Paris?")  # the same nodes, another question
    stats = llm.last_stats
    assert len(response.source_nodes) == 3 and stats["chunks_found"] == 3, stats
    assert stats["cached_tokens"] > 0 and stats["cache_hits"] > 0, stats


def test_ingestion_warms_the_servers_store(server: str) -> None:
    llm = CacheBlendLLM(base_url=server, api_key=KEY)
    step = CacheBlendKVPrecompute(llm=llm)
    assert step.target == f"server:{server}#{llm.model}" and KEY not in step.target
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=0), step])
    nodes = pipeline.run(documents=[Document(text=f"{p} Warmed at ingestion.") for p in PASSAGES])
    summary = llm.precompute([n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes])
    assert (summary.new, summary.present) == (0, len(nodes))  # all stored by the pipeline


class FixedRetriever(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=p, metadata={"source": f"doc{i}"}), score=1.0)
                for i, p in enumerate(PASSAGES)]


def test_a_function_agent_blends_the_tool_results_in_the_server(server: str) -> None:
    from llama_index.core.agent.workflow import FunctionAgent

    llm = CacheBlendLLM(base_url=server, api_key=KEY, max_new_tokens=48, temperature=0)  # room for the call
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, name="search", description="Search the documents.")
    # The first call is forced to be the tool's (a tiny random model would not choose it); the next call has
    # the tool's nodes in its conversation (the model may call again: the agent then stops with an answer).
    agent = FunctionAgent(tools=[tool], llm=llm, initial_tool_choice="search")
    recorder, dispatcher = StatsRecorder(calls=[]), get_dispatcher()
    dispatcher.add_event_handler(recorder)

    async def run():
        return await agent.run(user_msg="Who won two Nobel prizes?", max_iterations=2, early_stopping_method="generate")

    try:
        result = asyncio.run(run())
    finally:
        dispatcher.event_handlers.remove(recorder)
    assert [c.tool_name for c in result.tool_calls][:1] == ["search"]
    first, after_the_tool = recorder.calls[:2]
    assert first["chunks_found"] == 0
    assert after_the_tool["chunks_found"] == len(PASSAGES) and after_the_tool["cache_hits"] > 0, after_the_tool


class StatsRecorder(BaseEventHandler):
    """The stats of every LLM call, through LlamaIndex's instrumentation."""

    calls: List[dict] = []

    @classmethod
    def class_name(cls) -> str:
        return "StatsRecorder"

    def handle(self, event: Any, **kwargs: Any) -> None:
        stats = event.response.additional_kwargs if isinstance(event, LLMChatEndEvent) and event.response else {}
        if "mode" in stats:
            self.calls.append(dict(stats))


def test_retriever_tool_nodes_are_documents_of_the_answering_call(server: str) -> None:
    llm = CacheBlendLLM(base_url=server, api_key=KEY, max_new_tokens=4, temperature=0)
    tool = cacheblend_retriever_tool(FixedRetriever(), llm, name="lookup", description="Look the documents up.")
    output = tool.call(query="Nobel prizes")  # the postprocessor announces the nodes and warms them there
    call = {"id": "call_1", "name": "lookup", "arguments": {"query": "Nobel prizes"}}
    history = [ChatMessage(role="user", content="Who won two Nobel prizes?"),
               ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [call]}),
               ChatMessage(role="tool", blocks=output.blocks, additional_kwargs={"tool_call_id": "call_1"})]
    stats = llm.chat_with_tools([tool], chat_history=history).additional_kwargs
    assert stats["mode"] == "blend" and stats["chunks_found"] == len(PASSAGES), stats
    assert stats["cache_hits"] == len(PASSAGES) and stats["cached_tokens"] > 0, stats
