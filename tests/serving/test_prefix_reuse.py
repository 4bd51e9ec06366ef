"""The serving layer's prefix cache: what a request leaves behind, the next one opens with."""

from __future__ import annotations

import pytest
import torch
from langchain_cacheblend import ChatCacheBlend
from langchain_core.messages import HumanMessage
from llama_index.llms.cacheblend import CacheBlendLLM
from pydantic import ValidationError

from cacheblend_rag import BlendConfig, GenerationConfig
from cacheblend_rag.engine.prefix_cache import PrefixCache
from cacheblend_rag.engine.segments import PrefixSegment
from cacheblend_rag.serving import AnnouncedChunks, BlendService
from cacheblend_rag.store import ChunkCache, MemoryKVStore
from cacheblend_rag.store.format import peek_manifest
from cacheblend_rag.store.prefix_blocks import BLOCK_KEY_PREFIX, StorePrefixBlocks
from cacheblend_rag.testing import tiny_engine

SYSTEM = ("Given the context information and not prior knowledge, answer the query. The quick brown fox jumps "
          "over the lazy dog. Paris is the capital of France.")
CHUNK = "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris."
GREEDY = GenerationConfig(max_new_tokens=10, temperature=0.0)
BLEND = BlendConfig(recompute_ratio=0.15, min_blend_tokens=0)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def service_of(engine, prefix_cache=None, store=None):
    return BlendService(engine, ChunkCache(engine, store), AnnouncedChunks(64), prefix_cache)


def chat(engine, messages):
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_turn_two_of_a_chat_opens_with_the_previous_prompt_and_answer_as_exact_tokens(engine):
    cache = PrefixCache(1 << 24)
    service = service_of(engine, cache)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    first = service.generate(chat(engine, turn1), GREEDY, BLEND)
    assert first.prompt.prefix_tokens == 0 and first.stats()["prefix_cache_misses"] == 1
    assert first.stats()["prefix_cache_blocks"] > 0
    turn2 = turn1 + [{"role": "assistant", "content": first.result.text},
                     {"role": "user", "content": "And of Brazil?"}]
    second = service.generate(chat(engine, turn2), GREEDY, BLEND)
    ids1, ids2 = engine.tokenize(chat(engine, turn1)), engine.tokenize(chat(engine, turn2))
    held = ids1 + first.result.token_ids[:-1]  # the last answer token was sampled, never fed
    expected = min(common_prefix(held, ids2), len(ids2) - 1)  # to the token: partial blocks are kept
    assert expected >= len(ids1)  # the whole previous prompt, at least
    stats = second.stats()
    assert second.prompt.prefix_tokens == expected == stats["exact_tokens"] == stats["prefix_tokens"]
    assert stats["mode"] == "prefix_cached" and stats["recomputed_tokens"] == 0
    assert stats["fresh_tokens"] == len(ids2) - expected and stats["prefix_cache_hits"] == 1
    cold = service_of(engine).generate(chat(engine, turn2), GREEDY, BLEND)
    assert second.result.token_ids == cold.result.token_ids


def test_a_rag_prompt_reuses_its_lead_exactly_and_blends_the_chunks(engine):
    cache = PrefixCache(1 << 24)
    service = service_of(engine, cache)
    service.announce([CHUNK])
    lead = f"{SYSTEM}\nContext information is below.\n"

    def prompt(question):
        return f"{lead}{CHUNK}\nQuestion: {question}\nAnswer:"

    service.generate(prompt("Who won two Nobel prizes?"), GREEDY, BLEND)
    prepared = service.prepare(prompt("Where did Marie Curie work?"))
    m = prepared.prefix_tokens
    assert m == len(engine.tokenize(lead)) > 0  # the lead to its last token, not the blended chunk after it
    assert isinstance(prepared.segments[0], PrefixSegment)
    with_prefix = engine.blend(prepared.segments, config=BLEND, store=service.chunk_cache)
    assert with_prefix.stats.exact_tokens == m and with_prefix.stats.cache_hits == 1
    cold = service_of(engine)
    cold.announce([CHUNK])
    without = cold.prepare(prompt("Where did Marie Curie work?"))
    assert without.prefix_tokens == 0 and without.chunks_found == 1
    plain = engine.blend(without.segments, config=BLEND, store=service.chunk_cache)
    torch.testing.assert_close(with_prefix.logits, plain.logits, atol=1e-5, rtol=1e-5)


def test_prompts_that_differ_share_only_the_blocks_before_they_differ(engine):
    cache = PrefixCache(1 << 24)
    service = service_of(engine, cache)
    service.generate(f"{SYSTEM} Answer in French.\nQuestion: capital?\nAnswer:", GREEDY, BLEND)
    other = f"{SYSTEM.replace('Given', 'Taking')} Answer in French.\nQuestion: capital?\nAnswer:"
    assert service.prepare(other).prefix_tokens == 0  # differs in its first block: nothing shared
    same_lead = f"{SYSTEM} Answer in German, please.\nQuestion: capital?\nAnswer:"
    shared = common_prefix(engine.tokenize(same_lead), engine.tokenize(f"{SYSTEM} Answer in French."))
    assert service.prepare(same_lead).prefix_tokens == shared  # to the token, within a block


def test_a_prefix_cache_of_another_engine_model_finds_nothing(engine):
    cache = PrefixCache(1 << 24)
    service_of(engine, cache).generate(f"{SYSTEM}\nQuestion: capital?\nAnswer:", GREEDY, BLEND)
    other = tiny_engine("llama", seed=1)  # other weights, another fingerprint
    assert service_of(other, cache).prepare(f"{SYSTEM}\nQuestion: capital?\nAnswer:").prefix_tokens == 0


def test_blocks_written_through_a_shared_store_serve_another_replica_and_a_damaged_one_is_recomputed(engine):
    store = MemoryKVStore()
    prompt = f"{SYSTEM}\nQuestion: What is the capital of France?\nAnswer:"
    first_cache = ChunkCache(engine, store)
    writer = PrefixCache(1 << 24, backing=StorePrefixBlocks(first_cache))
    BlendService(engine, first_cache, AnnouncedChunks(8), writer).generate(prompt, GREEDY, BLEND)
    first_cache.flush()
    blocks = [k for k in store.keys() if k.startswith(BLOCK_KEY_PREFIX)]
    held = writer.stats()
    assert len(blocks) == held.blocks - held.partial_blocks >= 2  # the store holds full blocks only

    replica_cache = ChunkCache(engine, store)
    replica = PrefixCache(1 << 24, backing=StorePrefixBlocks(replica_cache))
    service = BlendService(engine, replica_cache, AnnouncedChunks(8), replica)
    full = service.prepare(prompt).prefix_tokens
    assert full >= 32 and replica.stats().store_blocks == full // 16

    # Damage the second block's first layer value in the store; a third replica meets it.
    second_block = engine.tokenize(prompt)
    from cacheblend_rag.engine.prefix_cache import block_keys
    name = BLOCK_KEY_PREFIX + block_keys(engine.fingerprint, second_block, 16)[1]
    manifest = peek_manifest(store.get_manifest(name))
    value = bytearray(store.get_layer(name, manifest.write_id, 0))
    value[40] ^= 0xFF
    store.put_layer(name, manifest.write_id, 0, bytes(value))
    third_cache = ChunkCache(engine, store)
    third = PrefixCache(1 << 24, backing=StorePrefixBlocks(third_cache))
    service = BlendService(engine, third_cache, AnnouncedChunks(8), third)
    served = service.generate(prompt, GREEDY, BLEND)
    assert served.prompt.prefix_tokens == 16  # the first block; the damaged one and those after it computed
    third_cache.flush()
    assert store.stats().corrupt == 1
    assert store.contains(name)  # written again from this request's own K/V
    fresh = PrefixCache(1 << 24, backing=StorePrefixBlocks(ChunkCache(engine, store)))
    assert BlendService(engine, third_cache, AnnouncedChunks(8), fresh).prepare(prompt).prefix_tokens == full


def test_both_integrations_report_the_prefix_cache_and_share_one_per_engine(engine):
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=4, prefix_cache_bytes="16MB")
    chat_model = ChatCacheBlend(engine=engine, max_tokens=4)
    assert llm.service.prefix_cache is chat_model.service.prefix_cache is not None
    assert llm.service.prefix_cache.max_bytes == 256 * 1024 * 1024  # the larger bound of the two
    prompt = f"{SYSTEM}\nQuestion: What is the capital of France?\nAnswer:"
    llm.complete(prompt)
    llm.complete(prompt)
    assert llm.last_stats["prefix_tokens"] > 0 and llm.last_stats["prefix_cache_blocks"] > 0
    assert llm.last_stats["prefix_cache_bytes"] > 0 and llm.last_stats["prefix_cache_hits"] >= 1
    message = chat_model.invoke([HumanMessage(content=prompt)])
    assert "prefix_cache_blocks" in message.response_metadata and "prefix_tokens" in message.response_metadata


def test_the_prefix_cache_bound_is_validated_and_zero_turns_it_off(engine):
    assert CacheBlendLLM.from_engine(engine, prefix_cache_bytes=0).service.prefix_cache is None
    for cls in (CacheBlendLLM, ChatCacheBlend):
        with pytest.raises(ValidationError, match="prefix_cache_bytes"):
            cls(engine=engine, prefix_cache_bytes=-5)
        with pytest.raises(ValidationError, match="not understood"):
            cls(engine=engine, prefix_cache_bytes="lots")


def test_reuse_off_neither_reads_nor_keeps_prefixes(engine):
    cache = PrefixCache(1 << 24)
    service = service_of(engine, cache)
    served = service.generate(f"{SYSTEM}\nQuestion: capital?\nAnswer:", GREEDY, BLEND, reuse=False)
    assert served.prompt.prefix_tokens == 0 and cache.stats().blocks == 0


def test_cache_stats_counts_prefix_blocks_apart_from_chunks(engine, tmp_path, capsys):
    import json

    from cacheblend_rag.cli import main

    llm = CacheBlendLLM.from_engine(engine, store_path=str(tmp_path / "kv"), prefix_cache_in_store=True,
                                    max_new_tokens=4)
    llm.precompute([CHUNK])
    llm.complete(f"{SYSTEM}\nQuestion: What is the capital of France?\nAnswer:")
    llm.chunk_cache.flush()
    blocks = llm.last_stats["prefix_cache_blocks"] - llm.last_stats["prefix_cache_partial_blocks"]
    assert blocks >= 2  # the full ones: partial blocks stay in memory
    assert main(["cache", "stats", "--path", str(tmp_path / "kv"), "--json"]) == 0
    by_codec = json.loads(capsys.readouterr().out)["by_codec"]
    assert by_codec["prefix blocks, float32"]["entries"] == blocks
    assert sum(share["entries"] for label, share in by_codec.items() if not label.startswith("prefix")) == 1


# --------------------------------------------------------------------------- spans after the chunks
def rag_chat(engine, history, question):
    """A CondensePlusContext-like prompt: the lead, the context, the app's system prompt, the history."""
    system = (f"The following is a friendly conversation between a user and an AI assistant.\n{CHUNK}\n\n"
              f"{SYSTEM} Always answer in one short sentence, and say so when the context does not say.")
    return chat(engine, [{"role": "system", "content": system}, *history, {"role": "user", "content": question}])


def test_the_system_prompt_and_earlier_turns_after_the_chunks_come_back_as_a_cached_segment(engine):
    from cacheblend_rag.serving.segment_cache import SegmentCache

    spans = SegmentCache(1 << 24, fingerprint=engine.fingerprint)
    service = BlendService(engine, ChunkCache(engine), AnnouncedChunks(8), PrefixCache(1 << 24), spans)
    service.announce([CHUNK])
    first = service.generate(rag_chat(engine, [], "Who won two Nobel prizes?"), GREEDY, BLEND)
    assert first.prompt.segment_tokens == 0 and spans.stats().entries == 1
    history = [{"role": "user", "content": "Who won two Nobel prizes?"},
               {"role": "assistant", "content": first.result.text}]
    prompt = rag_chat(engine, history, "Where did she work?")
    prepared = service.prepare(prompt)
    kinds = [type(s).__name__ for s in prepared.segments]
    assert kinds[-3:] == ["StoredSegment", "CachedSegment", "FreshSegment"], kinds
    span = prepared.segments[-2]
    assert span.chunk.approximate and len(span.chunk) == prepared.segment_tokens >= 16
    second = service.generate(prompt, GREEDY, BLEND)
    stats = second.stats()
    assert stats["segment_tokens"] == prepared.segment_tokens and stats["segment_cache_hits"] >= 1
    # Blended like a chunk, never taken for exact K/V: the exact prefix ends before the context.
    assert stats["exact_tokens"] == second.prompt.prefix_tokens
    assert stats["cached_tokens"] == stats["exact_tokens"] + len(engine.tokenize(CHUNK)) + stats["segment_tokens"]
    exact = engine.blend(prepared.segments, config=BlendConfig(recompute_ratio=1.0), store=service.chunk_cache)
    full = engine.full_prefill([t for s in prepared.segments for t in s.token_ids])
    torch.testing.assert_close(exact.logits, full.logits, atol=1e-5, rtol=1e-5)


def test_segment_cache_keeps_the_longest_span_within_its_bound(engine):
    from cacheblend_rag.serving.segment_cache import SegmentCache

    def kv(n):
        return [torch.ones(2, n, 16)] * 4, [torch.ones(2, n, 16)] * 4

    cache = SegmentCache(3 * 4 * 2 * 2 * 40 * 16 * 4 // 2, fingerprint="fp")  # room for 60 tokens
    assert not cache.remember(list(range(8)), *kv(8), "fp")  # shorter than min_tokens
    assert not cache.remember(list(range(20)), *kv(20), "other model")
    assert cache.remember(list(range(20)), *kv(20), "fp")
    assert cache.remember(list(range(30)), *kv(30), "fp")  # continues the first: replaces it
    assert cache.stats().entries == 1
    assert len(cache.match(list(range(25)) + [99], "fp")) == 25
    assert cache.match(list(range(25)), "fp", max_tokens=10) is None  # below min_tokens
    assert cache.match(list(range(25)), "other model") is None
    assert cache.remember(list(range(100, 140)), *kv(40), "fp")  # over the bound with the first: evicts it
    assert cache.stats().entries == 1 and cache.stats().evictions == 1 and cache.stats().bytes <= cache.max_bytes
