"""LlamaIndex chat engines over CacheBlendLLM on a tiny random Llama, with no code of ours beyond the LLM
and the postprocessor: from turn 2 on, only the new message and the template's glue (and, in a RAG
prompt, the separators between the chunks) may be fresh; the system prompt, the earlier turns and
the chunks are reused."""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any, Callable, List

import faiss
import pytest
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine, SimpleChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendNodePostprocessor
from llama_index.vector_stores.faiss import FaissVectorStore

from bench_support.conversation import answer_allowance, fresh_bound, partial_block_allowance
from cacheblend_rag.testing import tiny_engine

EMBED_DIM = 64
DOCUMENTS = [
    ("France", "Paris is the capital of France. The river Seine flows through Paris."),
    ("Curie", "Marie Curie was a physicist and chemist who won two Nobel prizes in Paris."),
    ("Amazon", "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean."),
    ("Fox", "The quick brown fox jumps over the lazy dog. The dog did not move."),
    ("Warsaw", "Marie Curie was born in Warsaw. Warsaw is the capital of Poland."),
]
SYSTEM = (
    "You are a helpful assistant for questions about European history and geography. Answer in one short "
    "sentence, name the place or the person first, and say so when the question cannot be answered."
)
TURNS = ["What is the capital of France?", "And who was born in Warsaw?", "Where does the Amazon flow?"]


class HashEmbedding(BaseEmbedding):
    """Bag of words hashed into a fixed number of buckets: deterministic, offline, instant."""

    dim: int = EMBED_DIM

    def _vector(self, text: str) -> List[float]:
        vector = [0.0] * self.dim
        for word in re.findall(r"[a-z]+", text.lower()):
            vector[int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % self.dim] += 1.0
        norm = sum(v * v for v in vector) ** 0.5 or 1.0
        return [v / norm for v in vector]

    def _get_text_embedding(self, text: str) -> List[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)


class AnswerTokens(BaseEventHandler):
    """The token ids of every chat answer, through LlamaIndex's instrumentation."""

    answers: List[List[int]] = []

    @classmethod
    def class_name(cls) -> str:
        return "AnswerTokens"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None and event.response.raw:
            self.answers.append(list(event.response.raw.get("token_ids", [])))


@pytest.fixture
def answer_tokens():
    handler = AnswerTokens(answers=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture
def llm(engine):
    # The RAG chat engines put the history after the chunks: only the segment cache (on by default) reuses it.
    return CacheBlendLLM.from_engine(engine, max_new_tokens=6)


def retriever(llm: CacheBlendLLM, k: int = 2) -> Any:
    documents = [Document(text=text, metadata={"title": title}) for title, text in DOCUMENTS]
    store = FaissVectorStore(faiss_index=faiss.IndexFlatL2(EMBED_DIM))
    index = VectorStoreIndex.from_documents(documents, storage_context=StorageContext.from_defaults(vector_store=store),
                                            embed_model=HashEmbedding())
    return index.as_retriever(similarity_top_k=k)


def simple(llm: CacheBlendLLM) -> Any:
    return SimpleChatEngine.from_defaults(llm=llm, system_prompt=SYSTEM)


def context(llm: CacheBlendLLM) -> Any:
    return ContextChatEngine.from_defaults(retriever(llm), llm=llm, system_prompt=SYSTEM,
                                           node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])


def condense_plus_context(llm: CacheBlendLLM) -> Any:
    return CondensePlusContextChatEngine.from_defaults(retriever(llm), llm=llm, system_prompt=SYSTEM,
                                                       node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])


def say_chat(chat_engine: Any, message: str, runner: asyncio.Runner) -> None:
    chat_engine.chat(message)


def say_stream_chat(chat_engine: Any, message: str, runner: asyncio.Runner) -> None:
    "".join(chat_engine.stream_chat(message).response_gen)


def say_achat(chat_engine: Any, message: str, runner: asyncio.Runner) -> None:
    # Every turn on the conversation's one loop, as an async application runs it: llama-index's chat memory
    # keeps an aiosqlite connection whose worker thread calls back into the loop that opened it, and a loop
    # closed after each turn (asyncio.run) left that thread raising into a dead loop.
    runner.run(chat_engine.achat(message))


@pytest.mark.parametrize("build", [simple, context, condense_plus_context],
                         ids=["SimpleChatEngine", "ContextChatEngine", "CondensePlusContextChatEngine"])
@pytest.mark.parametrize("say", [say_chat, say_stream_chat, say_achat], ids=["chat", "stream_chat", "achat"])
def test_later_turns_compute_only_the_new_message_fresh(llm, build: Callable[[CacheBlendLLM], Any], say,
                                                        answer_tokens):
    chat_engine = build(llm)
    tokenizer = llm.engine.tokenizer
    previous = 0  # the previous answer's tokens, if the history holds them changed
    with asyncio.Runner() as runner:
        for turn, message in enumerate(TURNS, start=1):
            say(chat_engine, message, runner)
            stats = llm.last_stats  # the call that answered the turn (a condense call comes before it)
            assert stats is not None
            assert {"exact_tokens", "reused_tokens", "recomputed_tokens", "fresh_tokens"} <= set(stats)
            if build is not simple:
                assert stats["chunks_found"] == 2, stats
            if turn > 1:
                # The bound (the prefix cache keeps partial blocks), plus the previous answer's allowance.
                bound = fresh_bound(tokenizer, message, prompt=llm.last_prompt, chunks=llm.service.announced.latest(),
                                    partial_block=partial_block_allowance(llm.service)) + previous
                assert stats["fresh_tokens"] <= bound, (turn, stats["fresh_tokens"], bound, stats)
            previous = answer_allowance(tokenizer, answer_tokens.answers[-1], chat_engine.chat_history[-1].content,
                                        stats["finish_reason"])
