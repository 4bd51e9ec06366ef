"""Where LangChain's ChatCacheBlend and this LLM do the same thing, they say it the same way: ``warm`` (with
``precompute`` a deprecated alias), the stats under ``"cacheblend"``, and ``timeout``."""

from __future__ import annotations

import pytest
from langchain_cacheblend import ChatCacheBlend
from llama_index.core.schema import TextNode

from cacheblend_rag.testing import tiny_engine
from llama_index.llms.cacheblend import CacheBlendLLM

CHUNK = "Fact: the river Varrow crosses seven valleys before it reaches the northern sea. " * 6


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=11)


def test_warm_stores_and_announces_as_langchains_does(engine):
    llm, chat = CacheBlendLLM(engine=engine, max_new_tokens=2), ChatCacheBlend(engine=engine, max_tokens=2)
    node = TextNode(text=CHUNK + "one")
    summary = llm.warm([node, CHUNK + "two"])
    assert summary.new == 2 and llm.announced.known() == [node.get_content(metadata_mode="llm"), CHUNK + "two"]
    again = chat.warm([CHUNK + "two"])
    assert again.new == 0 and again.present == 1  # the same store, the same keys
    quiet = CacheBlendLLM(engine=engine, max_new_tokens=2)
    assert quiet.warm([CHUNK + "three"], announce=False).new == 1 and quiet.announced.known() == []
    lonely = ChatCacheBlend(engine=engine, max_tokens=2)
    lonely.warm([CHUNK + "four"], announce=False, show_progress=False)
    assert lonely.announced.known() == []


def test_precompute_is_a_deprecated_warm_that_does_not_announce(engine):
    llm = CacheBlendLLM(engine=engine, max_new_tokens=2)
    with pytest.warns(DeprecationWarning, match=r"warm\(\)"):
        summary = llm.precompute([CHUNK + "five"])
    assert summary.new == 1 and llm.announced.known() == []


def test_each_response_has_its_stats_under_cacheblend_as_langchains_do(engine):
    llm = CacheBlendLLM(engine=engine, max_new_tokens=2)
    response = llm.complete("Hello")
    stats = response.additional_kwargs["cacheblend"]
    assert stats == {k: v for k, v in response.additional_kwargs.items() if k != "cacheblend"} == llm.last_stats
    langchain = ChatCacheBlend(engine=engine, max_tokens=2).invoke("Hello").response_metadata["cacheblend"]
    assert set(stats) == set(langchain)


def test_timeout_as_langchains(engine):
    with pytest.raises(TimeoutError):
        CacheBlendLLM(engine=engine, max_new_tokens=500, timeout=1e-6).complete("Hello")
    with pytest.raises(TimeoutError):
        CacheBlendLLM(engine=engine, max_new_tokens=500).complete("Hello", timeout=1e-6)
    with pytest.raises(ValueError, match="timeout=0.0 must be a positive number of seconds"):
        CacheBlendLLM(engine=engine, timeout=0)  # a ConfigError, which pydantic reports as its ValidationError
