"""Conversations through ChatCacheBlend on a tiny random Llama, with no code of ours beyond the chat model
and the retriever wrapper: ``invoke``/``stream``/``ainvoke`` on message lists, ``RunnableWithMessageHistory``
and a history-aware retrieval chain. From turn 2 on, only the new message and the template's glue (and,
in a RAG prompt, the separators between the chunks) may be fresh, and ``response_metadata`` says how
many tokens were exact, reused, recomputed and fresh."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest
from langchain_classic.chains import create_history_aware_retriever, create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_community.vectorstores import FAISS
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables.history import RunnableWithMessageHistory

from bench_support.conversation import TOKEN_STATS, fresh_bound, partial_block_allowance
from cacheblend_rag.testing import tiny_engine
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend
from langchain_cacheblend._messages import render_prompt

SYSTEM = (
    "You are a helpful assistant for questions about European history and geography. Answer in one short "
    "sentence, name the place or the person first, and say so when the question cannot be answered. "
    "Paris is the capital of France. Marie Curie was a physicist and chemist who won two Nobel prizes."
)
TURNS = ["What is the capital of France?", "And who won two Nobel prizes?", "Where does the Amazon flow?"]
TEXTS = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "The quick brown fox jumps over the lazy dog near the river.",
    "Paris is the capital of France. The capital of France is Paris.",
]


class MetadataCollector(BaseCallbackHandler):
    """The response metadata of every chat model run (a chain's parser drops it from the output)."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.runs.append(response.generations[0][0].message.response_metadata["cacheblend"])


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture
def llm(engine):
    return ChatCacheBlend(engine=engine, max_tokens=6)


def turn_bound(llm: ChatCacheBlend, message: str, prompt: str = "") -> int:
    """The bound on a later turn's fresh tokens, taken right after the turn (the chunks it announced), as the
    issue writes it: the prefix cache keeps partial blocks, so no allowance for them."""
    chunks = llm.service.announced.latest() if prompt else ()
    return fresh_bound(llm.get_engine().tokenizer, message, prompt=prompt, chunks=chunks,
                       partial_block=partial_block_allowance(llm.service))


def check_turns(stats: list[dict[str, Any]], bounds: list[int]) -> None:
    for turn, (turn_stats, bound) in enumerate(zip(stats, bounds), start=1):
        assert all(isinstance(turn_stats[name], int) for name in TOKEN_STATS), turn_stats
        if turn > 1:
            # The previous answer's last token when it ran out of tokens was sampled, never fed: no K/V.
            bound += 1 if stats[turn - 2].get("finish_reason") == "length" else 0
            assert turn_stats["fresh_tokens"] <= bound, (turn, turn_stats["fresh_tokens"], bound, turn_stats)
            assert turn_stats["exact_tokens"] > 0, (turn, turn_stats)


def invoke(llm: ChatCacheBlend, messages: list[BaseMessage]) -> AIMessage:
    return llm.invoke(messages)


def stream(llm: ChatCacheBlend, messages: list[BaseMessage]) -> AIMessage:
    chunks = list(llm.stream(messages))
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    return AIMessage(content=total.content, response_metadata=total.response_metadata)


def ainvoke(llm: ChatCacheBlend, messages: list[BaseMessage]) -> AIMessage:
    return asyncio.run(llm.ainvoke(messages))


@pytest.mark.parametrize("ask", [invoke, stream, ainvoke], ids=["invoke", "stream", "ainvoke"])
def test_message_lists(llm, ask: Callable[[ChatCacheBlend, list[BaseMessage]], AIMessage]):
    messages: list[BaseMessage] = [SystemMessage(SYSTEM)]
    stats = []
    for message in TURNS:
        messages.append(HumanMessage(message))
        answer = ask(llm, messages)
        messages.append(AIMessage(answer.content))
        stats.append(answer.response_metadata["cacheblend"])
    check_turns(stats, [turn_bound(llm, m) for m in TURNS])


def test_runnable_with_message_history(llm):
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), MessagesPlaceholder("history"), ("human", "{question}")])
    histories: dict[str, InMemoryChatMessageHistory] = {}
    chain = RunnableWithMessageHistory(
        prompt | llm, lambda session: histories.setdefault(session, InMemoryChatMessageHistory()),
        input_messages_key="question", history_messages_key="history")
    config = {"configurable": {"session_id": "one"}}
    stats = [chain.invoke({"question": message}, config=config).response_metadata["cacheblend"] for message in TURNS]
    assert len(histories["one"].messages) == 2 * len(TURNS)
    check_turns(stats, [turn_bound(llm, m) for m in TURNS])


def test_history_aware_retrieval_chain(engine):
    # The answer's prompt puts the history after the documents: only the segment cache (on by default) reuses it.
    llm = ChatCacheBlend(engine=engine, max_tokens=6)
    vectorstore = FAISS.from_documents([Document(page_content=t) for t in TEXTS], DeterministicFakeEmbedding(size=32))
    retriever = CacheBlendRetriever(retriever=vectorstore.as_retriever(search_kwargs={"k": 2}), llm=llm)
    rephrase = ChatPromptTemplate.from_messages([
        MessagesPlaceholder("chat_history"), ("human", "{input}"),
        ("human", "Given the conversation above, write a search query for the last question.")])
    answer = ChatPromptTemplate.from_messages([
        ("system", SYSTEM + "\n\nContext:\n{context}"), MessagesPlaceholder("chat_history"), ("human", "{input}")])
    chain = create_retrieval_chain(create_history_aware_retriever(llm, retriever, rephrase),
                                   create_stuff_documents_chain(llm, answer))
    collector = MetadataCollector()
    history: list[BaseMessage] = []
    stats, bounds = [], []
    for message in TURNS:
        result = chain.invoke({"input": message, "chat_history": history}, config={"callbacks": [collector]})
        turn_stats = dict(collector.runs[-1])  # the answer: the rephrasing call comes before it
        assert turn_stats["chunks_found"] == 2, turn_stats
        # The answer's prompt as the stuff chain renders it: its "\n\n" joins are glue too.
        context = "\n\n".join(d.page_content for d in result["context"])
        prompt = render_prompt(llm.get_engine().tokenizer, answer.format_messages(
            context=context, chat_history=history, input=message))
        stats.append(turn_stats)
        bounds.append(turn_bound(llm, message, prompt))
        history += [HumanMessage(message), AIMessage(result["answer"])]
    check_turns(stats, bounds)
