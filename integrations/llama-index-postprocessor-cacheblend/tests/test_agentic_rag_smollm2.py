"""Agentic RAG on SmolLM2: the model calls a RetrieverTool, the nodes come back in a tool message (as
FunctionAgent writes it), and the answering call blends them (read from the chunk store) behind the
earlier turns (the prefix cache)."""

from __future__ import annotations

from typing import List

import pytest
from llama_index.core.llms import ChatMessage
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import cacheblend_retriever_tool
from llama_index.postprocessor.cacheblend.nodes import node_chunk_text

K = 3


class FirstNodes(BaseRetriever):
    """The question's source article first, then the next ones: a ranking the test knows."""

    def __init__(self, nodes: List[TextNode]) -> None:
        super().__init__()
        self._nodes = nodes

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=n, score=1.0) for n in self._nodes[:K]]


@pytest.fixture(scope="module")
def smollm2_float32():
    """float32: ratio 1.0 is compared with full prefill token for token (in bfloat16 the prefix cache's
    blocks, computed in other kernel shapes, differ in the last bits)."""
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained(dtype="float32", min_blend_tokens=0)


def agent_loop(llm: CacheBlendLLM, nodes: List[TextNode], question: str):
    tool = cacheblend_retriever_tool(FirstNodes(nodes), llm, name="search_articles",
                                     description="Search the articles for passages about the question.")
    messages = [ChatMessage(role="user", content=question)]
    first = llm.chat_with_tools([tool], chat_history=messages, tool_required=True)  # the model writes the call
    (call,) = llm.get_tool_calls_from_response(first)
    output = tool.call(**call.tool_kwargs)
    messages += [first.message, ChatMessage(role="tool", blocks=output.blocks,
                                            additional_kwargs={"tool_call_id": call.tool_id})]
    return llm.chat_with_tools([tool], chat_history=messages)


@pytest.mark.slow
def test_smollm2_agent_blends_the_tool_results_and_matches_full_prefill_at_ratio_one(smollm2_float32) -> None:
    from cacheblend_rag.data import load_demo_corpus, load_demo_questions

    articles = load_demo_corpus()[:K]
    nodes = [TextNode(text=a.text, metadata={"title": a.title}) for a in articles]
    question = next(q.question for q in load_demo_questions() if q.source == articles[0].doc_id)
    texts = [node_chunk_text(n, MetadataMode.LLM) for n in nodes]
    answers = {}
    for ratio in (0.15, 1.0):
        llm = CacheBlendLLM(engine=smollm2_float32, max_new_tokens=16, temperature=0, recompute_ratio=ratio)
        llm.precompute(texts)  # the corpus, warmed up front
        answers[ratio] = agent_loop(llm, nodes, question)
    stats = answers[0.15].additional_kwargs
    node_tokens = sum(len(smollm2_float32.tokenize(t)) for t in texts)
    assert stats["mode"] == "blend" and (stats["chunks_found"], stats["cache_hits"]) == (K, K), stats
    assert stats["prefix_tokens"] > 0
    assert stats["cached_tokens"] - stats["prefix_tokens"] == node_tokens
    assert stats["reused_tokens"] - stats["prefix_tokens"] > 0.7 * node_tokens
    plain = CacheBlendLLM(engine=smollm2_float32, max_new_tokens=16, temperature=0, reuse_chunk_kv=False)
    assert answers[1.0].raw["token_ids"] == agent_loop(plain, nodes, question).raw["token_ids"]
