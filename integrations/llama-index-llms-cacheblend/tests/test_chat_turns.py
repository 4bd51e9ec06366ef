"""A conversation through CacheBlendLLM's chat paths (chat, stream_chat, achat, astream_chat) on a tiny
random Llama: turn 2 repeats turn 1's prompt and answer, so only the new message and the chat
template's glue around it may be fresh, and every response says where its tokens came from."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest
from llama_index.core.llms import ChatMessage

from bench_support.conversation import TOKEN_STATS, fresh_bound, partial_block_allowance
from cacheblend_rag.testing import tiny_engine
from llama_index.llms.cacheblend import CacheBlendLLM

# Long enough that reusing it matters (and past the engine's min_blend_tokens on the tiny tokenizer).
SYSTEM = (
    "You are a helpful assistant for questions about European history and geography. Answer in one short "
    "sentence, name the place or the person first, and say so when the question cannot be answered. "
    "Paris is the capital of France. Marie Curie was a physicist and chemist who won two Nobel prizes. "
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean."
)
TURNS = ["What is the capital of France?", "And who won two Nobel prizes?", "Where does the Amazon flow?"]

Ask = Callable[[CacheBlendLLM, list[ChatMessage]], tuple[str, dict[str, Any]]]


def ask_chat(llm: CacheBlendLLM, messages: list[ChatMessage]) -> tuple[str, dict[str, Any]]:
    response = llm.chat(messages)
    return response.message.content, response.additional_kwargs


def ask_stream_chat(llm: CacheBlendLLM, messages: list[ChatMessage]) -> tuple[str, dict[str, Any]]:
    responses = list(llm.stream_chat(messages))
    return responses[-1].message.content, responses[-1].additional_kwargs  # stats ride on the last delta


def ask_achat(llm: CacheBlendLLM, messages: list[ChatMessage]) -> tuple[str, dict[str, Any]]:
    response = asyncio.run(llm.achat(messages))
    return response.message.content, response.additional_kwargs


def ask_astream_chat(llm: CacheBlendLLM, messages: list[ChatMessage]) -> tuple[str, dict[str, Any]]:
    async def run() -> list[Any]:
        return [r async for r in await llm.astream_chat(messages)]

    responses = asyncio.run(run())
    return responses[-1].message.content, responses[-1].additional_kwargs


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def converse(llm: CacheBlendLLM, ask: Ask, turns: list[str]) -> list[dict[str, Any]]:
    """The stats of each turn of a conversation whose history holds every earlier answer."""
    messages = [ChatMessage(role="system", content=SYSTEM)]
    stats = []
    for question in turns:
        messages.append(ChatMessage(role="user", content=question))
        answer, turn_stats = ask(llm, messages)
        messages.append(ChatMessage(role="assistant", content=answer))
        stats.append(turn_stats)
    return stats


@pytest.mark.parametrize("ask", [ask_chat, ask_stream_chat, ask_achat, ask_astream_chat],
                         ids=["chat", "stream_chat", "achat", "astream_chat"])
def test_later_turns_compute_only_the_new_message_fresh(engine, ask):
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=6)
    stats = converse(llm, ask, TURNS)
    tokenizer = engine.tokenizer
    for turn, (question, turn_stats) in enumerate(zip(TURNS, stats), start=1):
        assert all(isinstance(turn_stats[name], int) for name in TOKEN_STATS), turn_stats
        counted = turn_stats["reused_tokens"] + turn_stats["recomputed_tokens"] + turn_stats["fresh_tokens"]
        assert counted == turn_stats["prompt_tokens"]  # exact tokens are among the reused ones
        if turn > 1:
            # The bound as written (the prefix cache keeps partial blocks: no allowance for them),
            # plus the previous answer's last token when it ran out of tokens: sampled, never fed, no K/V.
            previous = 1 if stats[turn - 2].get("finish_reason") == "length" else 0
            bound = fresh_bound(tokenizer, question, partial_block=partial_block_allowance(llm.service)) + previous
            assert partial_block_allowance(llm.service) == 0
            assert turn_stats["fresh_tokens"] <= bound, (turn, turn_stats["fresh_tokens"], bound, turn_stats)
            assert turn_stats["exact_tokens"] > 0, (turn, turn_stats)


def test_the_same_conversation_answers_the_same_on_every_path(engine):
    """Greedy decoding: the prefix reused from the previous turn changes no answer between paths."""
    def answers(ask: Ask) -> list[str]:
        llm = CacheBlendLLM.from_engine(engine, max_new_tokens=6)
        messages = [ChatMessage(role="system", content=SYSTEM)]
        out = []
        for question in TURNS[:2]:
            messages.append(ChatMessage(role="user", content=question))
            answer, _ = ask(llm, messages)
            messages.append(ChatMessage(role="assistant", content=answer))
            out.append(answer)
        return out

    assert answers(ask_chat) == answers(ask_stream_chat) == answers(ask_achat)
