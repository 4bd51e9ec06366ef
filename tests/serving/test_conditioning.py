"""Both integrations precompute chunks behind the template lead and the stand-in passage by default."""

from __future__ import annotations

import pytest

from cacheblend_rag.reuse.prompt import STAND_IN_PASSAGE, default_conditioning_prefix, template_lead
from cacheblend_rag.testing import tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def test_template_lead_is_the_text_before_the_user_content(engine):
    lead = template_lead(engine.tokenizer)
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                                    add_generation_prompt=True)
    assert lead and rendered.startswith(lead) and rendered[len(lead):].startswith("Hello there")
    prefix = default_conditioning_prefix(engine.tokenizer)
    assert prefix == engine.tokenize(lead) + engine.tokenize(STAND_IN_PASSAGE)


def test_template_lead_without_a_chat_template_is_empty():
    class Plain:
        chat_template = None

    assert template_lead(Plain()) == ""


def test_langchain_conditions_chunks_by_default(engine):
    from langchain_cacheblend import ChatCacheBlend

    conditioned = ChatCacheBlend(engine=engine)
    alone = ChatCacheBlend(engine=engine, condition_chunks=False)
    assert conditioned.chunk_cache.prefix_ids == tuple(default_conditioning_prefix(engine.tokenizer))
    assert alone.chunk_cache.prefix_ids == ()
    assert conditioned.chunk_cache is not alone.chunk_cache


def test_llamaindex_conditions_chunks_by_default(engine):
    from llama_index.llms.cacheblend import CacheBlendLLM
    from llama_index.postprocessor.cacheblend import CacheBlendKVPrecompute

    conditioned = CacheBlendLLM.from_engine(engine)
    alone = CacheBlendLLM.from_engine(engine, condition_chunks=False)
    assert conditioned.chunk_cache.prefix_ids == tuple(default_conditioning_prefix(engine.tokenizer))
    assert alone.chunk_cache.prefix_ids == ()
    # The ingestion cache must tell the two apart, or one would skip nodes the other never computed.
    assert CacheBlendKVPrecompute(llm=conditioned).target.split("#")[1] != \
        CacheBlendKVPrecompute(llm=alone).target.split("#")[1]
