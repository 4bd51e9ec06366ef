"""The serving layer's prefix cache: what a request leaves behind, the next one opens with."""

from __future__ import annotations

import pytest
import torch
from langchain_cacheblend import ChatCacheBlend
from langchain_core.messages import HumanMessage
from llama_index.llms.cacheblend import CacheBlendLLM
from pydantic import ValidationError

from cacheblend_rag import BlendConfig, GenerationConfig
from cacheblend_rag.reuse.prefix_cache import PrefixCache
from cacheblend_rag.kv.segments import PrefixSegment
from cacheblend_rag.serving import AnnouncedChunks, BlendService
from cacheblend_rag.store import ChunkCache, MemoryKVStore
from cacheblend_rag.store.format.chunk_bytes import peek_manifest
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
    assert first.prompt.prefix_tokens == 0 and service.stats()["prefix_cache"]["misses"] == 1
    assert service.stats()["prefix_cache"]["blocks"] > 0
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
    assert stats["fresh_tokens"] == len(ids2) - expected and service.stats()["prefix_cache"]["hits"] == 1
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
    service.chunk_cache.flush()  # the missed chunk is written back on a writer thread
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
    from cacheblend_rag.reuse.prefix_cache import block_keys
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
    held = llm.service.stats()["prefix_cache"]  # the cache's counters: the operator's, in no answer
    assert llm.last_stats["prefix_tokens"] > 0 and held["blocks"] > 0
    assert held["bytes"] > 0 and held["hits"] >= 1
    message = chat_model.invoke([HumanMessage(content=prompt)])
    stats = message.response_metadata["cacheblend"]
    assert "prefix_tokens" in stats and not any(k.startswith("prefix_cache_") for k in stats)


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
    held = llm.service.stats()["prefix_cache"]
    blocks = held["blocks"] - held["partial_blocks"]
    assert blocks >= 2  # the full ones: partial blocks stay in memory
    assert main(["cache", "stats", "--path", str(tmp_path / "kv"), "--json"]) == 0
    by_codec = json.loads(capsys.readouterr().out)["by_codec"]
    assert by_codec["prefix blocks, float32"]["entries"] == blocks
    assert sum(share["entries"] for label, share in by_codec.items() if not label.startswith("prefix")) == 1
    assert "prefix blocks (approximate), float32" not in by_codec  # nothing was blended yet
    # A blended request: its K/V past the lead goes in as approximate blocks, listed apart.
    llm.announce_chunks([CHUNK])
    llm.complete(f"{SYSTEM}\nContext: {CHUNK} {CHUNK}\nQuestion: Who won two Nobel prizes?\nAnswer:",
                 recompute_ratio=0.15, min_blend_tokens=0)
    llm.chunk_cache.flush()
    assert llm.last_stats["mode"] == "blend" and llm.service.stats()["prefix_cache"]["approximate_blocks"] > 0
    assert main(["cache", "stats", "--path", str(tmp_path / "kv"), "--json"]) == 0
    by_codec = json.loads(capsys.readouterr().out)["by_codec"]
    approximate = by_codec["prefix blocks (approximate), float32"]
    assert approximate["entries"] >= 1 and approximate["bytes"] > 0


# --------------------------------------------------------------------------- spans after the chunks
OTHER_CHUNK = "Albert Einstein was a physicist who developed the theory of relativity in Bern and Berlin."


def rag_chat(engine, history, question, chunk=CHUNK):
    """A CondensePlusContext-like prompt: the lead, the context, the app's system prompt, the history."""
    system = (f"The following is a friendly conversation between a user and an AI assistant.\n{chunk}\n\n"
              f"{SYSTEM} Always answer in one short sentence, and say so when the context does not say.")
    return chat(engine, [{"role": "system", "content": system}, *history, {"role": "user", "content": question}])


def test_the_system_prompt_and_earlier_turns_after_the_chunks_come_back_as_a_cached_segment(engine):
    from cacheblend_rag.reuse.segment_cache import SegmentCache

    spans = SegmentCache(1 << 24, fingerprint=engine.fingerprint)
    service = BlendService(engine, ChunkCache(engine), AnnouncedChunks(8), PrefixCache(1 << 24), spans)
    service.announce([CHUNK, OTHER_CHUNK])
    first = service.generate(rag_chat(engine, [], "Who won two Nobel prizes?"), GREEDY, BLEND)
    assert first.prompt.segment_tokens == 0 and spans.stats().entries == 1
    history = [{"role": "user", "content": "Who won two Nobel prizes?"},
               {"role": "assistant", "content": first.result.text}]
    # The context retrieved anew for turn 2 (as CondensePlusContext does): the prompt differs from turn 1's
    # at the chunk, so the prefix cache's approximate blocks of turn 1 reach no further than the lead.
    prompt = rag_chat(engine, history, "Where did she work?", chunk=OTHER_CHUNK)
    prepared = service.prepare(prompt, blend=BLEND)
    assert prepared.approximate_prefix_tokens == 0
    kinds = [type(s).__name__ for s in prepared.segments]
    assert kinds[-3:] == ["StoredSegment", "CachedSegment", "FreshSegment"], kinds
    span = prepared.segments[-2]
    assert span.chunk.approximate and len(span.chunk) == prepared.segment_tokens >= 16
    second = service.generate(prompt, GREEDY, BLEND)
    stats = second.stats()
    assert stats["segment_tokens"] == prepared.segment_tokens and service.stats()["segment_cache"]["hits"] >= 1
    # Blended like a chunk, never taken for exact K/V: the exact prefix ends before the context.
    assert stats["exact_tokens"] == second.prompt.prefix_tokens
    assert stats["cached_tokens"] == stats["exact_tokens"] + len(engine.tokenize(OTHER_CHUNK)) + stats["segment_tokens"]
    exact = engine.blend(prepared.segments, config=BlendConfig(recompute_ratio=1.0), store=service.chunk_cache)
    full = engine.full_prefill([t for s in prepared.segments for t in s.token_ids])
    torch.testing.assert_close(exact.logits, full.logits, atol=1e-5, rtol=1e-5)


def test_segment_cache_keeps_the_longest_span_within_its_bound(engine):
    from cacheblend_rag.reuse.segment_cache import SegmentCache

    def kv(n):
        return [torch.ones(2, n, 16)] * 4, [torch.ones(2, n, 16)] * 4

    cache = SegmentCache(3 * 4 * 2 * 2 * 40 * 16 * 4 // 2, fingerprint="fp")  # room for 60 tokens
    assert not cache.remember(list(range(8)), *kv(8), "fp")  # shorter than min_tokens
    assert not cache.remember(list(range(20)), *kv(20), "other model")
    assert cache.remember(list(range(20)), *kv(20), "fp")
    assert cache.remember(list(range(30)), *kv(30), "fp")  # continues the first: replaces it
    assert cache.stats().entries == 1
    assert len(cache.match(list(range(30)) + [99], "fp")) == 30  # the whole kept span, the prompt going on
    assert len(cache.match(list(range(25)), "fp")) == 25  # the whole of the prompt's span
    # Stops inside both (fixed text before new text): served only from min_partial_tokens on.
    assert cache.match(list(range(25)) + [99], "fp") is None
    lenient = SegmentCache(1 << 20, fingerprint="fp", min_partial_tokens=16)
    assert lenient.remember(list(range(30)), *kv(30), "fp") and len(lenient.match(list(range(25)) + [99], "fp")) == 25
    assert cache.match(list(range(25)), "fp", max_tokens=10) is None  # below min_tokens
    assert cache.match(list(range(25)), "other model") is None
    assert cache.remember(list(range(100, 140)), *kv(40), "fp")  # over the bound with the first: evicts it
    assert cache.stats().entries == 1 and cache.stats().evictions == 1 and cache.stats().bytes <= cache.max_bytes


# --------------------------------------------------------------------------- a blended request's K/V, approximate
CHUNKS2 = ["Paris is the capital of France and its largest city, on the river Seine in the north of the country.",
           "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean near the equator."]
EXACT = BlendConfig(recompute_ratio=1.0, min_blend_tokens=0)


def rag_turns(engine, first_answer):
    """Two turns of a chat whose retrieved chunks sit in each user message (bench_chat's layout)."""
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Passages:\n{CHUNK}\n\nWho won two Nobel prizes?"}]
    turn2 = turn1 + [{"role": "assistant", "content": first_answer},
                     {"role": "user", "content": f"Passages:\n{CHUNKS2[0]}\n\nWhat is the capital of France?"}]
    return chat(engine, turn1), chat(engine, turn2)


def first_turn(engine, service):
    service.announce([CHUNK, *CHUNKS2])
    turn1, _ = rag_turns(engine, "")
    first = service.generate(turn1, GREEDY, BLEND)
    assert first.result.stats.mode == "blend"
    _, turn2 = rag_turns(engine, first.result.text)
    held = engine.tokenize(turn1) + first.result.token_ids[:-1]  # the last answer token was sampled, never fed
    return first, turn2, held


def test_turn_two_of_a_rag_chat_reuses_turn_one_blended_prompt_and_answer_as_approximate_blocks(engine):
    cache = PrefixCache(1 << 24)
    service = service_of(engine, cache)
    first, turn2, held = first_turn(engine, service)
    exact_kv = first.result.stats.exact_kv_tokens
    assert 0 < exact_kv < first.result.prompt_tokens  # the lead before the chunk: exact; the rest blended
    after = cache.stats()
    assert after.approximate_blocks > 0 and after.approximate_bytes > 0
    ids2 = engine.tokenize(turn2)
    expected = min(common_prefix(held, ids2), len(ids2) - 1)
    assert expected >= len(engine.tokenize(rag_turns(engine, "")[0]))  # the whole previous prompt, at least
    # A share of the approximate history recomputed for this question (the default, 0, reuses it as is).
    cfg = BLEND.with_overrides(approximate_prefix_recompute_ratio=0.1)
    second = service.generate(turn2, GREEDY, cfg)
    stats = second.stats()
    exact = exact_kv  # to the token: the exact part's tail comes from its exact partial block
    assert second.prompt.prefix_tokens == stats["prefix_tokens"] == expected
    assert second.prompt.approximate_prefix_tokens == stats["approximate_prefix_tokens"] == expected - exact
    assert stats["exact_tokens"] == exact and stats["exact_kv_tokens"] == exact
    # The new chunk is blended under recompute_ratio, the approximate history under its own share (chosen
    # for this question); the exact part stays outside the budget.
    new_chunk = sum(len(s.token_ids) for s in second.prompt.segments[1:] if type(s).__name__ == "StoredSegment")
    assert new_chunk > 0 and stats["cached_tokens"] == expected + new_chunk
    from cacheblend_rag.engine.selection import selection_budget
    assert stats["recomputed_tokens"] == (selection_budget(BLEND.recompute_ratio, new_chunk)
                                          + selection_budget(0.1, expected - exact))
    assert min(second.result.stats.selected_positions) >= exact
    assert cache.stats().approximate_hit_tokens == expected - exact
    # Without the approximate blocks (exact ones only), the history after the lead is blended again.
    exact_only = service.prepare(turn2)
    assert exact_only.approximate_prefix_tokens == 0 and exact_only.prefix_tokens == exact_kv


def test_approximate_blocks_are_ignored_at_ratio_one_full_prefill_and_reuse_off(engine):
    cache = PrefixCache(1 << 24)
    service = service_of(engine, cache)
    first, turn2, _ = first_turn(engine, service)
    exact_kv = first.result.stats.exact_kv_tokens
    assert cache.stats().approximate_blocks > 0
    prepared = service.prepare(turn2, blend=EXACT)
    assert prepared.prefix_tokens == exact_kv and prepared.approximate_prefix_tokens == 0
    assert service.prepare(turn2, blend=BLEND).approximate_prefix_tokens > 0  # they are there
    ids2 = engine.tokenize(turn2)
    assert [t for s in prepared.segments for t in s.token_ids] == ids2
    exact = engine.blend(prepared.segments, config=EXACT, store=service.chunk_cache)
    assert exact.stats.exact_kv_tokens == len(ids2) and exact.stats.approximate_prefix_tokens == 0
    torch.testing.assert_close(exact.logits, engine.full_prefill(ids2).logits, atol=1e-5, rtol=1e-5)
    # Bit for bit what a cache that never held an approximate block gives.
    clean = PrefixCache(1 << 24)
    held_exact = service_of(engine, clean)
    held_exact.announce([CHUNK, *CHUNKS2])
    hit = cache.match(ids2, engine.fingerprint)
    clean.insert(hit.token_ids, [hit.kv[layer, 0][None] for layer in range(engine.num_layers)],
                 [hit.kv[layer, 1][None] for layer in range(engine.num_layers)], engine.fingerprint)
    again = engine.blend(held_exact.prepare(turn2, blend=EXACT).segments, config=EXACT, store=service.chunk_cache)
    assert torch.equal(exact.logits, again.logits)
    served = service.generate(turn2, GREEDY, EXACT)
    assert served.stats()["approximate_prefix_tokens"] == 0
    assert served.result.token_ids == engine.generate([ids2], GREEDY).token_ids
    # A prompt with no chunk in it (answered by full prefill) takes exact blocks only, at any ratio.
    no_chunk = turn2.replace(CHUNKS2[0], "The weather is fine.")
    assert service.prepare(no_chunk, blend=BLEND).approximate_prefix_tokens == 0
    assert service.generate(no_chunk, GREEDY, BLEND).stats()["approximate_prefix_tokens"] == 0
    plain = service.generate(turn2, GREEDY, BLEND, reuse=False)
    assert plain.prompt.prefix_tokens == 0 and plain.stats()["approximate_prefix_tokens"] == 0


def test_approximate_blocks_keep_their_flag_through_a_shared_store(engine):
    from cacheblend_rag.reuse.prefix_cache import block_keys
    from cacheblend_rag.store.prefix_blocks import APPROXIMATE_BLOCK_KEY_PREFIX

    store = MemoryKVStore()
    writer_cache = ChunkCache(engine, store)
    writer = PrefixCache(1 << 24, backing=StorePrefixBlocks(writer_cache))
    first, turn2, held = first_turn(engine, BlendService(engine, writer_cache, AnnouncedChunks(8), writer))
    writer_cache.flush()
    approx_names = [k for k in store.keys() if k.startswith(APPROXIMATE_BLOCK_KEY_PREFIX)]
    exact_names = [k for k in store.keys() if k.startswith(BLOCK_KEY_PREFIX) and k not in approx_names]
    exact_full = first.result.stats.exact_kv_tokens // 16  # full exact blocks; partial ones stay in memory
    assert len(exact_names) == exact_full >= 1 and len(approx_names) == len(held) // 16 - exact_full >= 1

    def replica():
        chunk_cache = ChunkCache(engine, store)
        service = BlendService(engine, chunk_cache, AnnouncedChunks(8), PrefixCache(1 << 24,
                               backing=StorePrefixBlocks(chunk_cache)))
        service.announce([CHUNK, *CHUNKS2])
        return service

    ids2 = engine.tokenize(turn2)
    reach = min(common_prefix(held, ids2), len(ids2) - 1) // 16 * 16  # full blocks only, from the store
    both = replica().prepare(turn2, blend=BLEND)
    assert both.prefix_tokens == reach and both.approximate_prefix_tokens == reach - 16 * exact_full
    only_exact = replica().prepare(turn2, blend=EXACT)
    assert only_exact.prefix_tokens == 16 * exact_full and only_exact.approximate_prefix_tokens == 0
    # An approximate entry copied under the exact name fails the manifest's key check: never read as exact.
    chain = block_keys(engine.fingerprint, ids2, 16)
    source, target = APPROXIMATE_BLOCK_KEY_PREFIX + chain[exact_full], BLOCK_KEY_PREFIX + chain[exact_full]
    manifest = peek_manifest(store.get_manifest(source))
    for layer in range(manifest.num_layers):
        store.put_layer(target, manifest.write_id, layer, store.get_layer(source, manifest.write_id, layer))
    assert store.add_manifest(target, store.get_manifest(source))
    corrupt = store.stats().corrupt
    assert replica().prepare(turn2, blend=EXACT).prefix_tokens == 16 * exact_full
    assert store.stats().corrupt == corrupt + 1 and not store.contains(target)
    assert replica().prepare(turn2, blend=BLEND).approximate_prefix_tokens == reach - 16 * exact_full


def test_both_integrations_report_approximate_prefix_tokens_in_a_rag_chat(engine):
    from langchain_core.messages import AIMessage, SystemMessage
    from llama_index.core.llms import ChatMessage

    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=4, recompute_ratio=0.15, min_blend_tokens=0)
    llm.precompute([CHUNK, *CHUNKS2])
    llm.announce_chunks([CHUNK, *CHUNKS2])
    user1 = f"Passages:\n{CHUNK}\n\nWho won two Nobel prizes?"
    user2 = f"Passages:\n{CHUNKS2[0]}\n\nWhat is the capital of France?"
    messages = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=user1)]
    answer = llm.chat(messages).message.content
    messages += [ChatMessage(role="assistant", content=answer), ChatMessage(role="user", content=user2)]
    stats = llm.chat(messages).additional_kwargs
    assert stats["approximate_prefix_tokens"] > 0 and llm.service.stats()["prefix_cache"]["approximate_blocks"] > 0
    assert stats["exact_tokens"] + stats["approximate_prefix_tokens"] == stats["prefix_tokens"]
    chat_model = ChatCacheBlend(engine=engine, max_tokens=4, recompute_ratio=0.15, min_blend_tokens=0)
    chat_model.announce_chunks([CHUNK, *CHUNKS2])
    lc = [SystemMessage(content=SYSTEM), HumanMessage(content=user1)]
    reply = chat_model.invoke(lc)
    meta = chat_model.invoke(lc + [AIMessage(content=reply.content), HumanMessage(content=user2)]).response_metadata["cacheblend"]
    assert "approximate_prefix_tokens" in meta
    assert meta["exact_tokens"] + meta["approximate_prefix_tokens"] == meta["prefix_tokens"]


def test_an_approximate_prefix_is_cut_back_to_a_chunk_or_span_it_would_end_inside(engine):
    """Approximate blocks of one prompt that reach a few tokens into another prompt's chunk (two chunks
    that open alike), or into its history after the chunks where the segment cache holds more of it,
    end where that chunk or span starts: the chunk is blended whole, the span comes from the segment cache."""
    from cacheblend_rag.kv.segments import CachedSegment, StoredSegment
    from cacheblend_rag.reuse.segment_cache import SegmentCache

    alike = "Marie Curie was born in Warsaw, the capital of Poland, and moved to Paris to study physics."
    spans = SegmentCache(1 << 24, fingerprint=engine.fingerprint)
    service = BlendService(engine, ChunkCache(engine), AnnouncedChunks(8), PrefixCache(1 << 24), spans)
    service.announce([CHUNK, alike, OTHER_CHUNK])
    service.generate(rag_chat(engine, [], "Who won two Nobel prizes?"), GREEDY, BLEND)
    prepared = service.prepare(rag_chat(engine, [], "Where was she born?", chunk=alike), blend=BLEND)
    chunk_at = [i for i, s in enumerate(prepared.segments) if isinstance(s, StoredSegment)]
    assert chunk_at and prepared.segments[chunk_at[0]].token_ids == tuple(engine.tokenize(alike))
    assert prepared.approximate_prefix_tokens == 0 and prepared.prefix_tokens == prepared.segments[0].exact_tokens
    # The history: another conversation's blocks reach into it (same chunk, same first question), but
    # this conversation's own span, kept by the segment cache from a prompt with another chunk, reaches further.
    history = [{"role": "user", "content": "Who won two Nobel prizes?"},
               {"role": "assistant", "content": "Marie Curie did, in physics and in chemistry."}]
    service.generate(rag_chat(engine, history, "Where did she work?", chunk=OTHER_CHUNK), GREEDY, BLEND)
    prompt = rag_chat(engine, history + [{"role": "user", "content": "Where did she work?"},
                                         {"role": "assistant", "content": "In Paris."}], "And where was she born?")
    ids = engine.tokenize(prompt)
    uncut = service.prefix_cache.match(ids, engine.fingerprint, approximate=True)
    prepared = service.prepare(prompt, blend=BLEND)
    span_start = len(engine.tokenize(rag_chat(engine, [], "x").split(CHUNK)[0])) + len(engine.tokenize(CHUNK))
    assert prepared.prefix_tokens == span_start < len(uncut)  # lead and chunk: reused as is, approximate
    assert isinstance(prepared.segments[1], CachedSegment) and prepared.segments[1].chunk.approximate
    assert span_start + prepared.segment_tokens > len(uncut)
