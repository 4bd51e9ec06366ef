"""The typical LCEL RAG chain over FAISS, with ChatCacheBlend and CacheBlendRetriever on a tiny model."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_community.vectorstores import FAISS
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from cacheblend_rag.testing import tiny_engine
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend

TEXTS = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "The quick brown fox jumps over the lazy dog near the river.",
    "Paris is the capital of France. The capital of France is Paris.",
    "Given the context information and not prior knowledge, answer the query.",
]
QUESTIONS = ["Who won two Nobel prizes?", "Where does the Amazon flow?", "What is the capital of France?"]
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer the question from the context.\n\nContext:\n{context}"), ("human", "{question}")]
)


def format_docs(documents: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in documents)


class MetadataCollector(BaseCallbackHandler):
    """Keeps the response metadata of every chat model run (the parser drops it from the output)."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.runs.append(response.generations[0][0].message.response_metadata["cacheblend"])


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def vectorstore() -> FAISS:
    documents = [Document(page_content=t, metadata={"id": i}) for i, t in enumerate(TEXTS)]
    return FAISS.from_documents(documents, DeterministicFakeEmbedding(size=32))


def make_chain(retriever: Any, llm: ChatCacheBlend):
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | PROMPT
        | llm
        | StrOutputParser()
    )


def cacheblend_chain(engine, vectorstore, **llm_args: Any):
    llm = ChatCacheBlend(engine=engine, max_tokens=12, **llm_args)
    retriever = CacheBlendRetriever(retriever=vectorstore.as_retriever(search_kwargs={"k": 2}), llm=llm)
    return make_chain(retriever, llm), retriever, llm


def test_retriever_returns_documents_unchanged_and_prepares_their_kv(engine, vectorstore) -> None:
    inner = vectorstore.as_retriever(search_kwargs={"k": 2})
    llm = ChatCacheBlend(model="tiny-qwen2")  # a fresh engine: nothing cached yet
    retriever = CacheBlendRetriever(retriever=inner, llm=llm)
    question = QUESTIONS[0]
    documents = retriever.invoke(question)
    assert documents == inner.invoke(question)
    for document in documents:
        assert llm.chunk_cache.contains(llm.get_engine().tokenize(document.page_content))
        assert document.page_content in llm.known_chunk_texts


def test_chain_reuses_the_cache(engine, vectorstore) -> None:
    chain, retriever, _ = cacheblend_chain(engine, vectorstore)
    summary = retriever.warm(vectorstore.docstore._dict.values(), show_progress=False)
    assert summary.new + summary.present == len(TEXTS)
    collector = MetadataCollector()
    answer = chain.invoke(QUESTIONS[0], config={"callbacks": [collector]})
    assert isinstance(answer, str) and answer
    stats = collector.runs[-1]
    assert stats["mode"] == "blend" and stats["chunks_found"] == 2
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0
    assert stats["reused_tokens"] > 0 and 0 < stats["recomputed_tokens"] < stats["cached_tokens"]


def test_ratio_one_matches_full_prefill(engine, vectorstore) -> None:
    blended_chain, _, _ = cacheblend_chain(engine, vectorstore, recompute_ratio=1.0)
    # Told about no chunk and keeping no prefix: full prefill
    plain_llm = ChatCacheBlend(engine=engine, max_tokens=12, prefix_cache_bytes=0)
    plain_chain = make_chain(vectorstore.as_retriever(search_kwargs={"k": 2}), plain_llm)
    for question in QUESTIONS:
        blended, plain = MetadataCollector(), MetadataCollector()
        a = blended_chain.invoke(question, config={"callbacks": [blended]})
        b = plain_chain.invoke(question, config={"callbacks": [plain]})
        assert blended.runs[-1]["mode"] == "blend" and plain.runs[-1]["mode"] == "full_prefill"
        run = blended.runs[-1]  # every cached token recomputed, but the exact prefix an earlier question left
        assert run["recomputed_tokens"] == run["cached_tokens"] - run["exact_tokens"] > 0
        assert blended.runs[-1]["prompt_tokens"] == plain.runs[-1]["prompt_tokens"]
        assert a == b


async def test_stream_batch_and_async_agree_with_invoke(engine, vectorstore) -> None:
    chain, _, _ = cacheblend_chain(engine, vectorstore)
    expected = [chain.invoke(q) for q in QUESTIONS]
    assert ["".join(chain.stream(q)) for q in QUESTIONS] == expected
    assert chain.batch(QUESTIONS) == expected
    assert [await chain.ainvoke(q) for q in QUESTIONS] == expected
    assert await chain.abatch(QUESTIONS) == expected
    streamed = []
    for q in QUESTIONS:  # not one comprehension: an async one nested in a sync one is Python 3.11 syntax
        streamed.append("".join([c async for c in chain.astream(q)]))
    assert streamed == expected


@pytest.mark.slow
def test_smollm2_chain_reuses_cache_and_matches_full_prefill_at_ratio_one(smollm2_engine) -> None:
    from cacheblend_rag.data import load_demo_corpus, load_demo_questions

    articles = load_demo_corpus()[:4]
    documents = [Document(page_content=f"{a.title}\n{a.text}") for a in articles]
    store = FAISS.from_documents(documents, DeterministicFakeEmbedding(size=32))
    question = next(q.question for q in load_demo_questions() if q.source == articles[0].doc_id)
    runs = {}
    for name, ratio in (("reuse", 0.15), ("exact", 1.0)):
        chain, retriever, _ = cacheblend_chain(smollm2_engine, store, recompute_ratio=ratio)
        retriever.warm(documents, show_progress=False)
        collector = MetadataCollector()
        runs[name] = (chain.invoke(question, config={"callbacks": [collector]}), collector.runs[-1])
    plain = MetadataCollector()
    full_answer = make_chain(store.as_retriever(search_kwargs={"k": 2}), ChatCacheBlend(
        engine=smollm2_engine, max_tokens=12)).invoke(question, config={"callbacks": [plain]})
    reuse, exact = runs["reuse"][1], runs["exact"][1]
    assert reuse["mode"] == "blend" and reuse["cache_hits"] == 2 and reuse["reused_tokens"] > 0
    # The chat template keeps each chunk verbatim and the prompt keeps the whole-prompt token ids.
    assert exact["prompt_tokens"] == plain.runs[-1]["prompt_tokens"] == reuse["prompt_tokens"]
    assert runs["exact"][0] == full_answer
