"""LangChain's standard retriever suite, run against CacheBlendRetriever wrapping a FAISS retriever
(deterministic fake embeddings) and ChatCacheBlend on the tiny random Llama."""

from __future__ import annotations

import functools
from typing import Any

from langchain_community.vectorstores import FAISS
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_tests.integration_tests import RetrieversIntegrationTests

from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend

TEXTS = [
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "The Amazon river flows into the Atlantic Ocean.",
    "Mount Everest is the highest mountain above sea level.",
    "The Great Wall of China is thousands of kilometres long.",
    "Ada Lovelace wrote the first published computer program.",
    "The Danube flows through ten countries.",
]


@functools.lru_cache(maxsize=1)
def _vectorstore() -> FAISS:
    return FAISS.from_documents([Document(page_content=t) for t in TEXTS], DeterministicFakeEmbedding(size=32))


class TestCacheBlendRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[CacheBlendRetriever]:
        return CacheBlendRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        # The wrapped retriever returns 4 by default: k must cut to fewer and ask it for its own k.
        return {"retriever": _vectorstore().as_retriever(), "llm": ChatCacheBlend(model="tiny-llama")}

    @property
    def retriever_query_example(self) -> str:
        return "Which river flows into the Atlantic?"
