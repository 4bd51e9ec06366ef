"""Agentic RAG on SmolLM2: the model calls a retriever tool, the tool's documents come back in a ToolMessage,
and the answering call blends them (read from the chunk store) behind the earlier turns (the prefix cache)."""

from __future__ import annotations

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.retrievers import BaseRetriever

from langchain_cacheblend import ChatCacheBlend, cacheblend_retriever_tool

K = 3


@pytest.fixture(scope="module")
def smollm2_float32():
    """SmolLM2 in float32: ratio 1.0 is compared with full prefill token for token, and in bfloat16 the prefix
    cache's blocks (computed by another call, in other kernel shapes) differ from a one-pass prefill in the
    last bits, enough to flip a greedy token now and then."""
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained(dtype="float32", min_blend_tokens=0)


class FirstDocuments(BaseRetriever):
    """The question's source article first, then the next ones: a retriever whose ranking a test can know."""

    documents: list[Document]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return self.documents[:K]


def agent_loop(llm: ChatCacheBlend, documents: list[Document], question: str):
    tool = cacheblend_retriever_tool(FirstDocuments(documents=documents), llm, "search_articles",
                                     "Search the articles for passages about the question.")
    messages = [HumanMessage(question)]
    call = llm.bind_tools([tool], tool_choice="search_articles").invoke(messages)  # the model writes the call
    assert call.tool_calls and call.tool_calls[0]["name"] == "search_articles"
    messages += [call, tool.invoke(call.tool_calls[0])]
    return llm.bind_tools([tool]).invoke(messages)


@pytest.mark.slow
def test_smollm2_agent_blends_the_tool_results_and_matches_full_prefill_at_ratio_one(smollm2_float32) -> None:
    from cacheblend_rag.data import load_demo_corpus, load_demo_questions

    articles = load_demo_corpus()[:K]
    documents = [Document(page_content=f"{a.title}\n{a.text}") for a in articles]
    question = next(q.question for q in load_demo_questions() if q.source == articles[0].doc_id)
    answers = {}
    for ratio in (0.15, 1.0):
        llm = ChatCacheBlend(engine=smollm2_float32, max_tokens=16, temperature=0, recompute_ratio=ratio)
        llm.warm(documents, show_progress=False)  # the corpus, warmed up front
        answers[ratio] = agent_loop(llm, documents, question)
    stats = answers[0.15].response_metadata["cacheblend"]
    passage_tokens = sum(len(smollm2_float32.tokenize(d.page_content)) for d in documents)
    assert stats["mode"] == "blend" and (stats["chunks_found"], stats["cache_hits"]) == (K, K), stats
    assert stats["prefix_tokens"] > 0  # the tools' description and the question, from the first call
    assert stats["cached_tokens"] - stats["prefix_tokens"] == passage_tokens  # every passage token had chunk KV
    assert stats["reused_tokens"] - stats["prefix_tokens"] > 0.7 * passage_tokens  # most of them reused as is
    plain = ChatCacheBlend(engine=smollm2_float32, max_tokens=16, temperature=0, reuse_chunk_kv=False)
    assert answers[1.0].content == agent_loop(plain, documents, question).content
