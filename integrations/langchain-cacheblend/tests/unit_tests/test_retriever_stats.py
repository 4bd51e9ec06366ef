"""What CacheBlendRetriever computes for a query is told apart from store hits in the chat model's stats."""

from __future__ import annotations

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.retrievers import BaseRetriever

from cacheblend_rag.testing import tiny_engine
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend

CHUNKS = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
]


class FixedRetriever(BaseRetriever):
    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=c) for c in CHUNKS]


def _ask(llm: ChatCacheBlend, retriever: CacheBlendRetriever) -> dict:
    context = "\n\n".join(d.page_content for d in retriever.invoke("Who won two Nobel prizes?"))
    messages = [SystemMessage(f"Answer from the context.\nContext:\n{context}\n"), HumanMessage("Who?")]
    return llm.invoke(messages).response_metadata["cacheblend"]


def test_chunks_the_retriever_computes_for_a_query_are_not_store_hits() -> None:
    # prefix_cache_bytes=0: the query asked again would come back from the prefix cache (the first
    # answer's approximate blocks), and this test counts what the second one reads from the store.
    llm = ChatCacheBlend(engine=tiny_engine("llama"), max_tokens=3, min_blend_tokens=0, prefix_cache_bytes=0)
    retriever = CacheBlendRetriever(retriever=FixedRetriever(), llm=llm)
    first = _ask(llm, retriever)
    assert first["mode"] == "blend" and first["chunks_found"] == 2
    assert (first["cache_hits"], first["cache_misses"], first["precomputed_for_request"]) == (0, 0, 2)
    second = _ask(llm, retriever)  # now they were stored before the query
    assert (second["cache_hits"], second["cache_misses"], second["precomputed_for_request"]) == (2, 0, 0)


def test_chunks_warmed_up_front_are_store_hits() -> None:
    llm = ChatCacheBlend(engine=tiny_engine("llama"), max_tokens=3, min_blend_tokens=0)
    retriever = CacheBlendRetriever(retriever=FixedRetriever(), llm=llm)
    retriever.warm(CHUNKS, show_progress=False)
    meta = _ask(llm, retriever)
    assert (meta["cache_hits"], meta["cache_misses"], meta["precomputed_for_request"]) == (2, 0, 0)
