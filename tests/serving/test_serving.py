"""The serving layer both integrations stand on: the same settings, one lock per engine, one chunk
cache per engine and store, one path from prompt to answer."""

from __future__ import annotations

import pytest
from langchain_cacheblend import ChatCacheBlend
from langchain_core.messages import HumanMessage
from llama_index.core.llms import ChatMessage
from llama_index.llms.cacheblend import CacheBlendLLM
from pydantic import ValidationError

from cacheblend_rag import BlendConfig
from cacheblend_rag.serving import BLEND_FIELDS, AnnouncedChunks, CacheBlendSettings, chunk_text
from cacheblend_rag.testing import tiny_engine

CHUNK = "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris."


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def test_both_integrations_expose_every_blend_field_with_the_same_default():
    assert set(BLEND_FIELDS) == set(BlendConfig.__dataclass_fields__)
    shared = set(CacheBlendSettings.model_fields)
    for cls in (CacheBlendLLM, ChatCacheBlend):
        assert shared <= set(cls.model_fields)
        for name in shared:
            assert cls.model_fields[name].default == CacheBlendSettings.model_fields[name].default, (cls, name)


@pytest.mark.parametrize("cls", [CacheBlendLLM, ChatCacheBlend])
def test_show_progress_reaches_the_load_and_does_not_name_another_engine(cls, tmp_path, monkeypatch):
    """``show_progress=True`` asks the loader for transformers' bars; off (the default) it asks for nothing and
    the environment decides. The engine is the same either way (the flag is not part of its key)."""
    from cacheblend_rag.serving import registry
    from cacheblend_rag.testing import save_tiny_model

    folder = str(save_tiny_model(tmp_path / f"model-{cls.__name__}"))
    asked = []

    def load(model, device, dtype, tokenizer, model_kwargs, show_progress=None):
        asked.append(show_progress)
        return tiny_engine("llama")

    monkeypatch.setattr(registry, "_load", load)
    loud = cls(model=folder, show_progress=True)
    quiet = cls(model=folder)
    assert asked == [True] and quiet.engine is loud.engine
    assert cls.model_fields["show_progress"].default is False


@pytest.mark.parametrize("field, value", [("recompute_ratio", 1.5), ("selection", "nope"), ("profile_tokens", 0),
                                          ("storage_dtype", "int3"),
                                          ("deviation", "both"), ("check_layer", 9), ("store_size_limit", "lots"),
                                          ("resident_bytes", -1)])
def test_both_integrations_refuse_a_bad_value_with_the_same_message(engine, field, value):
    messages = []
    for cls in (CacheBlendLLM, ChatCacheBlend):
        with pytest.raises(ValidationError) as info:
            cls(engine=engine, **{field: value})
        messages.append(info.value.errors()[0]["msg"])
    assert messages[0] == messages[1] and str(value) in messages[0]


def test_unknown_arguments_are_refused_with_a_suggestion_in_both(engine):
    for cls in (CacheBlendLLM, ChatCacheBlend):
        with pytest.raises(ValidationError, match=r"'recompute_raito' \(did you mean 'recompute_ratio'\?\)"):
            cls(engine=engine, recompute_raito=0.2)


def test_one_engine_has_one_lock_and_one_chunk_cache_per_store_whichever_framework_uses_it(engine, tmp_path):
    llama, chain = CacheBlendLLM.from_engine(engine), ChatCacheBlend(engine=engine)
    assert llama.service.scheduler is chain.service.scheduler
    assert llama.chunk_cache is chain.chunk_cache
    on_disk = CacheBlendLLM.from_engine(engine, store_path=str(tmp_path / "kv"))
    assert on_disk.chunk_cache is not llama.chunk_cache
    assert on_disk.chunk_cache is ChatCacheBlend(engine=engine, store_path=str(tmp_path / "kv")).chunk_cache


def test_llamaindex_opens_any_store_spec(engine, tmp_path):
    llm = CacheBlendLLM.from_engine(engine, store_path=f"tiered:{tmp_path / 'kv'}", max_new_tokens=3)
    assert type(llm.chunk_cache.store).__name__ == "TieredKVStore"
    llm.precompute([CHUNK])
    llm.announce_chunks([CHUNK])
    llm.complete(f"Context:\n{CHUNK}\nQuestion: who?\nAnswer:")
    assert llm.last_stats["mode"] == "blend" and llm.last_stats["cache_hits"] == 1


def test_chunk_texts_have_one_normal_form_in_both(engine):
    assert chunk_text("  text with edges \n") == "text with edges"
    announced = AnnouncedChunks(capacity=2)
    assert announced.announce(["  a ", "", " ", "b"]) == ["a", "b"]
    chain, llama = ChatCacheBlend(engine=engine), CacheBlendLLM.from_engine(engine)
    chain.announce_chunks([f"\n{CHUNK}\n\n"])
    llama.announce_chunks([f"\n{CHUNK}\n\n"])
    assert chain.known_chunk_texts == llama.service.announced.known() == [CHUNK]


def test_both_integrations_answer_a_prompt_the_same_way(engine):
    """Same engine, same prompt, same settings: the same segments, stats and text."""
    # Both cold: with the segment cache (on by default) the second request would blend the question span
    # the first one computed (a slightly different answer, by design), and with the prefix cache, which
    # keeps partial blocks, it would reuse the first's lead exactly (the same answer, other counts).
    cold = {"segment_cache_bytes": 0, "prefix_cache_bytes": 0}
    chain = ChatCacheBlend(engine=engine, max_tokens=8, **cold)
    llama = CacheBlendLLM.from_engine(engine, max_new_tokens=8, **cold)
    for llm in (chain, llama):
        llm.announce_chunks([CHUNK])
    question = f"Context:\n{CHUNK}\nWho won two Nobel prizes?"
    lc = chain.invoke([HumanMessage(question)])
    li = llama.chat([ChatMessage(role="user", content=question)])
    assert lc.content == li.message.content
    for key in ("mode", "cached_tokens", "recomputed_tokens", "chunks_found", "prompt_tokens"):
        assert lc.response_metadata["cacheblend"][key] == li.additional_kwargs[key], key


def test_both_integrations_store_chunks_in_the_codec_asked_for(engine):
    for cls in (CacheBlendLLM, ChatCacheBlend):
        quantized = cls(engine=engine, storage_dtype="int8")
        assert quantized.chunk_cache.codec.name == "int8"
        assert quantized.chunk_cache is not cls(engine=engine).chunk_cache  # another key space
        with pytest.raises(ValidationError, match="storage_dtype='int3' is not supported"):
            cls(engine=engine, storage_dtype="int3")


def test_both_integrations_size_the_host_memory_tier_as_asked(engine):
    for cls in (CacheBlendLLM, ChatCacheBlend):
        assert cls(engine=engine).chunk_cache.resident.max_bytes <= 1 << 30  # a CPU's default
        held = cls(engine=engine, resident_bytes="64MB")
        assert held.chunk_cache.resident.max_bytes == 64_000_000
        assert held.chunk_cache is cls(engine=engine, resident_bytes=64_000_000).chunk_cache
        assert held.chunk_cache is not cls(engine=engine).chunk_cache
