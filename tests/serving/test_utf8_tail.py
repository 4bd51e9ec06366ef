"""An answer cut by ``max_new_tokens`` in the middle of a character (issue 25, item 5): the
incomplete UTF-8 sequence at the end is dropped from the text, and no streamed delta carries one.
SmolLM2 spells emoji and CJK over several byte tokens, so cuts after 1, 2, 4, 5, 7, 8 or 11 new
tokens fall inside a character for this prompt."""

from __future__ import annotations

import pytest
from langchain_cacheblend import ChatCacheBlend
from llama_index.llms.cacheblend import CacheBlendLLM

PROMPT = "Repeat: 🍰😀 日本"
CUTS = range(1, 13)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return CacheBlendLLM(temperature=0.0)


@pytest.fixture(scope="module")
def full_answer(llm):
    return llm.complete(PROMPT, max_new_tokens=32).text


@pytest.mark.parametrize("cut", CUTS)
def test_a_cut_answer_ends_on_a_whole_character(llm, full_answer, cut):
    text = llm.complete(PROMPT, max_new_tokens=cut).text
    assert "\ufffd" not in text and full_answer.startswith(text)
    deltas = [r.delta for r in llm.stream_complete(PROMPT, max_new_tokens=cut)]
    assert not any("\ufffd" in (d or "") for d in deltas) and "".join(d or "" for d in deltas) == text


@pytest.mark.parametrize("cut", [4, 8, 11])
def test_langchain_streams_no_half_character_either(cut):
    chat = ChatCacheBlend(temperature=0.0, max_tokens=cut)
    pieces = [chunk.content for chunk in chat.stream(PROMPT)]
    assert not any("\ufffd" in piece for piece in pieces)
    assert "\ufffd" not in chat.invoke(PROMPT).content
