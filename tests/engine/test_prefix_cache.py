"""The prefix cache (cacheblend_rag/reuse/prefix_cache.py) and blends that open with a cached prefix."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig, CachedSegment, FreshSegment
from cacheblend_rag.reuse.prefix_cache import PrefixCache, block_keys
from cacheblend_rag.kv.segments import PrefixSegment
from cacheblend_rag.engine.selection import selection_budget
from cacheblend_rag.errors import BlendInputError, ChunkMismatchError, ConfigError
from cacheblend_rag.testing import tiny_engine

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
LEAD = ("Given the context information and not prior knowledge, answer the query. Context information is below. "
        "The quick brown fox jumps over the lazy dog.\n")
CHUNKS = [
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
]
QUESTION = "\nQuestion: What is the capital of France? Answer:"


def fake_kv(layers: int, n: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, 2, n, 8, generator=g) for _ in range(layers)]
    values = [torch.randn(1, 2, n, 8, generator=g) for _ in range(layers)]
    return keys, values


def block_bytes(layers: int = 2, block: int = 4) -> int:
    return layers * 2 * 2 * block * 8 * 4


# --------------------------------------------------------------------------- the cache alone
def test_block_keys_chain_the_prefix_the_model_and_the_salt():
    ids = list(range(40))
    keys = block_keys("model-a", ids, 16)
    assert len(keys) == 2  # the last 8 tokens are no full block
    assert block_keys("model-a", ids[:32] + [7] * 5, 16) == keys  # a block's key names its prefix only
    assert block_keys("model-a", [99] + ids[1:], 16)[1] != keys[1]  # ... all of it: a change before it
    assert block_keys("model-b", ids, 16)[0] != keys[0]
    assert block_keys("model-a", ids, 16, salt="tenant-2")[0] != keys[0]
    with pytest.raises(ValueError, match="fingerprint is empty"):
        block_keys("", ids, 16)


def test_match_returns_the_longest_cached_block_aligned_prefix_and_keeps_the_last_token_fresh():
    """Whole blocks only (``partial_blocks=False``, vLLM's granularity)."""
    cache = PrefixCache(1 << 20, block_size=4, partial_blocks=False)
    ids = list(range(10, 24))  # 14 tokens: 3 full blocks
    keys, values = fake_kv(2, 14)
    assert cache.insert(ids, keys, values, "fp") == 3
    assert cache.insert(ids, keys, values, "fp") == 0  # already held
    hit = cache.match(ids + [1, 2, 3], "fp")
    assert isinstance(hit, PrefixSegment) and hit.token_ids == tuple(ids[:12])
    assert hit.kv.shape == (2, 2, 2, 12, 8)
    assert torch.equal(hit.kv[1, 0], keys[1][0, :, :12]) and torch.equal(hit.kv[0, 1], values[0][0, :, :12])
    # A prompt that is exactly the cached blocks: its last token is held back, so one block less.
    assert cache.match(ids[:12], "fp").token_ids == tuple(ids[:8])
    assert cache.match(ids[:5] + [0] * 9, "fp").token_ids == tuple(ids[:4])  # diverges in block 2
    assert cache.match([0] + ids[1:], "fp") is None  # diverges in block 1
    stats = cache.stats()
    assert (stats.blocks, stats.hits, stats.misses, stats.hit_tokens) == (3, 3, 1, 12 + 8 + 4)
    assert stats.bytes == 3 * block_bytes()
    assert stats.queried_tokens == 16 + 11 + 13 + 13 and cache.hit_rate == 24 / 53


def test_match_reaches_to_the_token_with_partial_blocks():
    """The default: the tokens after the last full block are kept as a partial block, and a match goes
    on into any block after its full ones as far as the prompt agrees with it."""
    cache = PrefixCache(1 << 20, block_size=4)
    ids = list(range(10, 24))  # 14 tokens: 3 full blocks and a partial one of 2
    keys, values = fake_kv(2, 14)
    assert cache.insert(ids, keys, values, "fp") == 4
    assert cache.insert(ids, keys, values, "fp") == 0  # already held
    hit = cache.match(ids + [1, 2, 3], "fp")
    assert isinstance(hit, PrefixSegment) and hit.token_ids == tuple(ids)
    assert hit.kv.shape == (2, 2, 2, 14, 8)
    assert torch.equal(hit.kv[1, 0], keys[1][0, :, :14]) and torch.equal(hit.kv[0, 1], values[0][0, :, :14])
    # The prompt is the first 12: its last token is held back, and 3 of block 3's tokens still serve.
    assert cache.match(ids[:12], "fp").token_ids == tuple(ids[:11])
    assert cache.match(ids[:5] + [0] * 9, "fp").token_ids == tuple(ids[:5])  # diverges inside block 2
    assert cache.match(ids[:13] + [0], "fp").token_ids == tuple(ids[:13])  # inside the partial block
    assert cache.match([0] + ids[1:], "fp") is None  # diverges at the first token
    stats = cache.stats()
    assert (stats.blocks, stats.partial_blocks, stats.hits, stats.misses) == (4, 1, 4, 1)
    assert stats.hit_tokens == 14 + 11 + 5 + 13 and stats.partial_hits == 4
    assert stats.bytes == 3 * block_bytes() + block_bytes() // 2


def test_a_prompt_shorter_than_a_block_is_kept_and_a_longer_insert_supersedes_its_partial_block():
    cache = PrefixCache(1 << 20, block_size=4)
    keys, values = fake_kv(2, 10)
    assert cache.insert([1, 2], [k[:, :, :2] for k in keys], [v[:, :, :2] for v in values], "fp") == 1
    assert cache.match([1, 2, 9], "fp").token_ids == (1, 2)
    assert cache.match([1, 2, 9], "fp", salt="other") is None and cache.match([1, 2, 9], "fp2") is None
    # The same prefix grown to 3 tokens: the partial block of 2 is superseded by one of 3.
    assert cache.insert([1, 2, 3], keys, values, "fp") == 1
    assert (cache.stats().blocks, cache.stats().partial_blocks) == (1, 1)
    # ... and to a full block and one more token: a full block and a partial one of 1 remain.
    assert cache.insert([1, 2, 3, 4, 5], keys, values, "fp") == 2
    assert (cache.stats().blocks, cache.stats().partial_blocks) == (2, 1)
    assert cache.stats().bytes == block_bytes() + block_bytes() // 4
    hit = cache.match([1, 2, 3, 4, 5, 6], "fp")
    assert hit.token_ids == (1, 2, 3, 4, 5)
    assert torch.equal(hit.kv[0, 0], keys[0][0, :, :5]) and torch.equal(hit.kv[1, 1], values[1][0, :, :5])
    # A shorter insert of what is held adds nothing; a diverging partial block lives beside the first.
    assert cache.insert([1, 2, 3, 4, 5], keys, values, "fp") == 0
    assert cache.insert([1, 2, 3], keys, values, "fp") == 0
    assert cache.insert([1, 2, 3, 4, 7, 8], keys, values, "fp") == 1
    assert cache.stats().partial_blocks == 2
    assert cache.match([1, 2, 3, 4, 7, 8, 0], "fp").token_ids == (1, 2, 3, 4, 7, 8)
    assert cache.match([1, 2, 3, 4, 5, 0], "fp").token_ids == (1, 2, 3, 4, 5)


def test_partial_blocks_are_leaves_evicted_least_recently_used_first():
    one = block_bytes()
    cache = PrefixCache(2 * one + one // 2, block_size=4)  # one full block and up to three partial ones of 2
    keys, values = fake_kv(2, 6)
    lead = [1, 2, 3, 4]
    cache.insert(lead + [5, 6], keys, values, "fp")
    cache.insert(lead + [7, 8], keys, values, "fp")
    cache.insert(lead + [9, 10], keys, values, "fp")
    assert (cache.stats().blocks, cache.stats().partial_blocks, cache.stats().evictions) == (4, 3, 0)
    assert cache.match(lead + [5, 6, 0], "fp").token_ids == (1, 2, 3, 4, 5, 6)  # now the most recent
    cache.insert(lead + [11, 12], keys, values, "fp")  # no room: the least recent leaf goes, not the lead
    stats = cache.stats()
    assert (stats.blocks, stats.partial_blocks, stats.evictions) == (4, 3, 1)
    assert cache.match(lead + [7, 8, 0], "fp").token_ids == tuple(lead)  # evicted: the full block stays
    for tail in ([5, 6], [9, 10], [11, 12]):
        assert cache.match(lead + tail + [0], "fp").token_ids == tuple(lead + tail)
    cache.resize(one)  # only the full block fits: every partial block goes, its parent stays
    assert (cache.stats().blocks, cache.stats().partial_blocks) == (1, 0)
    assert cache.match(lead + [5, 6, 0], "fp").token_ids == tuple(lead)


def test_inserted_blocks_are_copies_not_views_of_the_callers_buffer():
    cache = PrefixCache(1 << 20, block_size=4)
    keys, values = fake_kv(2, 8)
    cache.insert(list(range(8)), keys, values, "fp")
    expected = keys[0][0, :, :4].clone()
    keys[0].zero_()
    assert torch.equal(cache.match(list(range(9)), "fp").kv[0, 0, :, :4], expected)


def test_other_models_tenants_and_texts_never_share_blocks():
    cache = PrefixCache(1 << 20, block_size=4)
    ids = list(range(12))
    cache.insert(ids, *fake_kv(2, 12), "model-a", salt="tenant-1")
    assert cache.match(ids, "model-b", salt="tenant-1") is None
    assert cache.match(ids, "model-a", salt="tenant-2") is None
    assert cache.match(ids, "model-a") is None
    assert cache.match([5] + ids[1:], "model-a", salt="tenant-1") is None
    assert len(cache.match(ids, "model-a", salt="tenant-1").token_ids) == 11  # all but the last, to the token


def test_the_byte_bound_evicts_least_recently_used_leaves_so_chains_stay_prefixes():
    one = block_bytes()
    cache = PrefixCache(5 * one, block_size=4, partial_blocks=False)  # whole blocks: the test counts them
    lead = list(range(8))
    first, second = lead + [100, 101, 102, 103], lead + [200, 201, 202, 203]
    cache.insert(first + [0], *fake_kv(2, 13, seed=1), "fp")  # lead (2 blocks) + 1
    cache.insert(second + [0], *fake_kv(2, 13, seed=2), "fp")  # shares the lead: +1 block
    assert cache.stats().blocks == 4
    assert cache.match(first + [9], "fp").token_ids == tuple(first)  # first is now the more recent
    third = list(range(50, 62))
    cache.insert(third + [0], *fake_kv(2, 13, seed=3), "fp")  # 3 new blocks, room for 1: evict 2 leaves
    stats = cache.stats()
    assert stats.blocks == 5 and stats.bytes <= 5 * one and stats.evictions == 2
    # The least recently used leaf went first (second's last block), then first's: the lead stays.
    assert cache.match(second + [9], "fp").token_ids == tuple(lead)
    assert cache.match(first + [9], "fp").token_ids == tuple(lead)
    assert cache.match(third + [9], "fp").token_ids == tuple(third)


def test_a_block_larger_than_the_bound_is_not_kept_and_zero_disables():
    assert PrefixCache(10, block_size=4).insert(list(range(8)), *fake_kv(2, 8), "fp") == 0
    off = PrefixCache(0, block_size=4)
    assert not off.enabled and off.insert(list(range(8)), *fake_kv(2, 8), "fp") == 0
    assert off.match(list(range(9)), "fp") is None


def test_resize_evicts_down_to_the_new_bound():
    cache = PrefixCache(1 << 20, block_size=4)
    cache.insert(list(range(16)), *fake_kv(2, 16), "fp")
    cache.resize(2 * block_bytes())
    assert cache.stats().blocks == 2 and cache.match(list(range(17)), "fp").token_ids == tuple(range(8))
    cache.resize(0)
    assert cache.stats().blocks == 0


# --------------------------------------------------------------------------- exact and approximate blocks
def test_approximate_blocks_are_matched_only_when_asked_and_count_as_approximate_from_the_first_on():
    cache = PrefixCache(1 << 20, block_size=4)
    ids = list(range(10, 24))  # 14 tokens
    exact_kv, blended_kv = fake_kv(2, 14, seed=1), fake_kv(2, 14, seed=2)
    assert cache.insert(ids[:6], *exact_kv, "fp") == 2  # a full block and a partial one of 2
    assert cache.insert(ids, *blended_kv, "fp", approximate=True) == 3  # blocks 1, 2 and a partial one of 2
    exact = cache.match(ids + [99], "fp")
    assert exact.token_ids == tuple(ids[:6]) and exact.approximate_tokens == 0 and exact.exact_tokens == 6
    assert torch.equal(exact.kv[0, 0], exact_kv[0][0][0, :, :6])
    both = cache.match(ids + [99], "fp", approximate=True)
    # Block 1 is approximate, but its first 2 tokens are the exact partial block's: exact to the token.
    assert both.token_ids == tuple(ids) and both.approximate_tokens == 8 and both.exact_tokens == 6
    assert torch.equal(both.kv[1, 0, :, :6], exact_kv[0][1][0, :, :6])
    assert torch.equal(both.kv[1, 1, :, 6:], blended_kv[1][1][0, :, 6:14])
    # Diverging inside block 1: the exact partial block and the approximate full one agree on 2 tokens,
    # and the exact one is taken.
    tie = cache.match(ids[:6] + [0, 0, 0], "fp", approximate=True)
    assert tie.token_ids == tuple(ids[:6]) and tie.approximate_tokens == 0
    assert cache.match(ids[:7] + [0, 0], "fp", approximate=True).approximate_tokens == 1  # the approximate one reaches further
    stats = cache.stats()
    assert (stats.blocks, stats.partial_blocks, stats.approximate_blocks) == (5, 2, 3)
    assert stats.approximate_bytes == 2 * block_bytes() + block_bytes() // 2
    assert stats.approximate_hit_tokens == 8 + 1 and stats.hit_tokens == 6 + 14 + 6 + 7


def test_exact_blocks_win_over_approximate_ones_and_upgrade_them_in_place():
    cache = PrefixCache(1 << 20, block_size=4)
    ids = list(range(12))
    exact_kv, blended_kv, other_kv = fake_kv(2, 12, seed=1), fake_kv(2, 12, seed=2), fake_kv(2, 12, seed=3)
    assert cache.insert(ids, *blended_kv, "fp", approximate=True) == 3
    assert cache.match(ids + [99], "fp") is None  # approximate blocks only: nothing exact
    assert cache.insert(ids[:8], *exact_kv, "fp") == 2  # the first two, upgraded
    stats = cache.stats()
    assert (stats.blocks, stats.approximate_blocks, stats.upgraded_blocks) == (3, 1, 2)
    hit = cache.match(ids + [99], "fp", approximate=True)
    assert hit.approximate_tokens == 4 and torch.equal(hit.kv[0, 0, :, :8], exact_kv[0][0][0, :, :8])
    # An approximate insert of the same tokens changes nothing: exact K/V is never overwritten.
    assert cache.insert(ids, *other_kv, "fp", approximate=True) == 0
    again = cache.match(ids + [99], "fp", approximate=True)
    assert torch.equal(again.kv, hit.kv)
    assert cache.match(ids + [99], "fp").token_ids == tuple(ids[:8])
    # Partial blocks: an approximate one never supersedes an exact one it extends; an exact one of the
    # same tokens replaces an approximate one.
    small = PrefixCache(1 << 20, block_size=4)
    assert small.insert([1, 2], *exact_kv, "fp") == 1
    assert small.insert([1, 2, 3], *blended_kv, "fp", approximate=True) == 1
    assert small.insert([1, 2], *other_kv, "fp", approximate=True) == 0  # covered
    assert (small.stats().partial_blocks, small.stats().approximate_blocks) == (2, 1)
    assert small.match([1, 2, 3, 9], "fp").token_ids == (1, 2)
    assert small.match([1, 2, 3, 9], "fp", approximate=True).approximate_tokens == 1  # (1, 2) from the exact one
    assert small.insert([1, 2, 3], *exact_kv, "fp") == 1  # exact now: the approximate one is replaced
    assert (small.stats().partial_blocks, small.stats().approximate_blocks) == (1, 0)
    exact_hit = small.match([1, 2, 3, 9], "fp", approximate=True)
    assert exact_hit.approximate_tokens == 0 and torch.equal(exact_hit.kv[0, 0], exact_kv[0][0][0, :, :3])


def test_blocks_after_an_approximate_block_count_as_approximate_whatever_their_flag():
    """A chain whose approximate block is followed by exact ones (a store evicted the exact parent, say):
    an exact match stops at the approximate block, one that allows them counts everything after it."""
    cache = PrefixCache(1 << 20, block_size=4, partial_blocks=False)
    ids = list(range(12))
    cache.insert(ids, *fake_kv(2, 12, seed=1), "fp")
    chain = block_keys("fp", ids, 4)
    cache._blocks[chain[1]].approximate = True
    assert cache.match(ids + [99], "fp").token_ids == tuple(ids[:4])
    assert cache.match(ids + [99], "fp", approximate=True).approximate_tokens == 8


def test_a_prefix_segment_checks_its_approximate_tokens():
    kv = torch.zeros(2, 2, 2, 4, 8)
    with pytest.raises(BlendInputError, match="approximate_tokens=5"):
        PrefixSegment([1, 2, 3, 4], kv, approximate_tokens=5)
    with pytest.raises(BlendInputError, match="approximate_tokens=True"):
        PrefixSegment([1, 2, 3, 4], kv, approximate_tokens=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_bytes": -1}, "max_bytes=-1"), ({"max_bytes": 1.5}, "max_bytes=1.5"),
    ({"max_bytes": 10, "block_size": 0}, "block_size=0"),
])
def test_settings_are_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PrefixCache(**kwargs)


# --------------------------------------------------------------------------- blends with a cached prefix
def prompt(engine):
    lead = engine.tokenize(LEAD)
    chunk_ids = [engine.tokenize(c) for c in CHUNKS]
    question = engine.tokenize(QUESTION)
    full = lead + [t for c in chunk_ids for t in c] + question
    return lead, chunk_ids, question, full


def rotated(engine, chunk):
    """A chunk computed behind nothing, as the prefix cache keeps it: keys rotated at positions 0..n-1."""
    a = engine.adapter
    n = len(chunk)
    cos, sin = a.rope_cos_sin(chunk.keys[0][None], torch.arange(n).unsqueeze(0))
    return [a.apply_rope(k[None], cos, sin) for k in chunk.keys], [v[None] for v in chunk.values]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prefix_from_the_cache_blends_bit_for_bit_as_the_same_exact_chunk(arch):
    """The prefix cache's path is the exact-prefix path: a hit blends exactly as the same K/V passed as
    an exact cached chunk does, at every ratio, and at 1.0 it is full prefill."""
    engine = tiny_engine(arch)
    lead, chunk_ids, question, full_ids = prompt(engine)
    chunks = engine.prefill_chunks(chunk_ids)
    lead_chunk = engine.prefill_chunk(lead)
    cache = PrefixCache(1 << 24, block_size=16)
    cache.insert(lead, *rotated(engine, lead_chunk), engine.fingerprint)
    hit = cache.match(full_ids, engine.fingerprint)
    m = len(hit.token_ids)
    assert m == len(lead)  # to the token: the lead's last, partial block too
    from_cache = [hit, *map(CachedSegment, chunks), FreshSegment(question)]
    as_chunk = [CachedSegment(engine.prefill_chunk(lead[:m])), *map(CachedSegment, chunks), FreshSegment(question)]
    n_blendable = sum(map(len, chunk_ids))
    for ratio in (1.0, 0.15, 0.0):
        cfg = BlendConfig(recompute_ratio=ratio)
        a, b = engine.blend(from_cache, config=cfg), engine.blend(as_chunk, config=cfg)
        assert torch.equal(a.logits, b.logits), ratio
        assert a.stats.selected_positions == b.stats.selected_positions
        assert a.stats.exact_tokens == m and a.stats.prefix_tokens == m and b.stats.prefix_tokens == 0
        assert a.stats.recomputed_tokens == selection_budget(ratio, n_blendable)
        assert a.stats.cached_tokens == m + n_blendable
        assert a.stats.exact_kv_tokens == (len(full_ids) if ratio == 1.0 else len(lead))
        for layer in range(engine.num_layers):
            assert torch.equal(a.cache.layers[layer].keys, b.cache.layers[layer].keys)
    exact = engine.blend(from_cache, config=BlendConfig(recompute_ratio=1.0))
    torch.testing.assert_close(exact.logits, engine.full_prefill(full_ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_cached_up_to_its_question_computes_only_the_rest(arch):
    """Turn 2 of a chat: the previous prompt and answer are cached (from full prefill's K/V); only the
    new message is computed, and the answer is full prefill's."""
    engine = tiny_engine(arch)
    _, _, question, full_ids = prompt(engine)
    full = engine.full_prefill(full_ids)
    cache = PrefixCache(1 << 24, block_size=16)
    cache.insert(full_ids, [layer.keys for layer in full.cache.layers], [layer.values for layer in full.cache.layers],
                 engine.fingerprint)
    new_turn = full_ids + question
    hit = cache.match(new_turn, engine.fingerprint)
    m = len(hit.token_ids)
    assert m == len(full_ids)
    out = engine.generate([hit, FreshSegment(new_turn[m:])], config=BlendConfig(recompute_ratio=0.15),
                          max_new_tokens=8)
    assert out.stats.mode == "prefix_cached" and out.stats.exact_tokens == m == out.stats.prefix_tokens
    assert out.stats.fresh_tokens == len(new_turn) - m and out.stats.recomputed_tokens == 0
    assert out.stats.fallback_reason is None
    reference = engine.model.generate(torch.tensor([new_turn]), max_new_tokens=8, do_sample=False)
    expected = reference[0, len(new_turn):].tolist()
    eos = engine.tokenizer.eos_token_id
    assert out.token_ids == (expected[: expected.index(eos)] if eos in expected else expected)
    torch.testing.assert_close(engine.blend([hit, FreshSegment(new_turn[m:])]).logits,
                               engine.full_prefill(new_turn).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def second_turn(engine):
    """Turn 2 of a RAG chat: turn 1 was blended, so its K/V past the lead is approximate; kept as
    approximate blocks, its match opens turn 2. Returns the hit, the new chunk, the question, the lead."""
    lead, chunk_ids, question, full_ids = prompt(engine)
    chunks = engine.prefill_chunks(chunk_ids)
    turn1 = engine.blend([FreshSegment(lead), *map(CachedSegment, chunks), FreshSegment(question)],
                         config=BlendConfig(recompute_ratio=0.15))
    exact_kv = turn1.stats.exact_kv_tokens
    assert exact_kv == len(lead) < len(full_ids)
    keys, values = [layer.keys for layer in turn1.cache.layers], [layer.values for layer in turn1.cache.layers]
    cache = PrefixCache(1 << 24, block_size=16)
    cache.insert(full_ids[:exact_kv], keys, values, engine.fingerprint)
    cache.insert(full_ids, keys, values, engine.fingerprint, approximate=True)
    new_chunk = engine.prefill_chunk(chunk_ids[2])
    turn2 = full_ids + question
    assert cache.match(turn2, engine.fingerprint).token_ids == tuple(lead)  # exact only: the lead
    hit = cache.match(turn2, engine.fingerprint, approximate=True)
    # The block the lead ends in is approximate, the lead's tail comes from its exact partial block.
    assert len(hit) == len(full_ids) and hit.approximate_tokens == len(hit) - len(lead)
    return hit, new_chunk, question, lead


@pytest.mark.parametrize("arch", ARCHS)
def test_a_blended_prompt_comes_back_as_an_approximate_prefix_reused_as_is_and_counted_apart(arch):
    """At approximate_prefix_recompute_ratio 0 an approximate prefix opens turn 2 as is (nothing
    recomputed, outside the budget), only what is new is blended, with approximate_prefix_chunk_factor times
    the chunks' share, and the stats count it apart from the exact tokens. At factor 1.0 the flag changes no
    number."""
    engine = tiny_engine(arch)
    hit, new_chunk, question, lead = second_turn(engine)
    m, exact = len(hit), len(lead)
    segments = [hit, CachedSegment(new_chunk), FreshSegment(question)]
    tripled = engine.blend(segments, config=BlendConfig(recompute_ratio=0.15)).stats
    assert BlendConfig().approximate_prefix_chunk_factor == 3.0
    assert tripled.recomputed_tokens == selection_budget(0.45, len(new_chunk))
    assert tripled.approximate_prefix_tokens == m - exact and tripled.exact_tokens == exact
    cfg = BlendConfig(recompute_ratio=0.15, approximate_prefix_recompute_ratio=0.0, approximate_prefix_chunk_factor=1.0)
    out = engine.blend(segments, config=cfg)
    stats = out.stats
    assert stats.prefix_tokens == m and stats.approximate_prefix_tokens == m - exact and stats.exact_tokens == exact
    assert stats.recomputed_tokens == selection_budget(0.15, len(new_chunk)) and stats.exact_kv_tokens == exact
    assert stats.cached_tokens == m + len(new_chunk) and stats.fresh_tokens == len(question)
    # The same K/V passed as an exact prefix: the same blend, bit for bit; only the stats differ.
    as_exact = engine.blend([PrefixSegment(hit.token_ids, hit.kv), *segments[1:]], config=cfg)
    assert torch.equal(out.logits, as_exact.logits)
    assert out.stats.selected_positions == as_exact.stats.selected_positions
    assert as_exact.stats.exact_tokens == m and as_exact.stats.approximate_prefix_tokens == 0
    # Behind an exact prefix the chunks keep their own share whatever the factor.
    exact_default = engine.blend([PrefixSegment(hit.token_ids, hit.kv), *segments[1:]], config=BlendConfig()).stats
    assert exact_default.recomputed_tokens == selection_budget(0.15, len(new_chunk))
    # Nothing left to blend: prefix_cached, and only the exact part of it is exact K/V.
    only = engine.blend([hit, FreshSegment(question)], config=cfg)
    assert only.stats.mode == "prefix_cached" and only.stats.exact_kv_tokens == exact


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("share", [0.1, 0.5, None])
def test_an_approximate_prefix_is_blended_with_its_own_share_and_the_exact_part_never(arch, share):
    """Below ratio 1.0 a share of an approximate prefix's tokens is recomputed, chosen by the strategy
    among them (its own pool, or with the chunks at None); the exact part (the lead) stays outside the
    budget and is never recomputed; the stats still count the approximate tokens as from the prefix."""
    engine = tiny_engine(arch)
    hit, new_chunk, question, lead = second_turn(engine)
    m, exact = len(hit), len(lead)
    approximate = m - exact
    cfg = BlendConfig(recompute_ratio=0.15, approximate_prefix_recompute_ratio=share)
    out = engine.blend([hit, CachedSegment(new_chunk), FreshSegment(question)], config=cfg)
    stats = out.stats
    expected = (selection_budget(0.15, approximate + len(new_chunk)) if share is None else
                selection_budget(0.15, len(new_chunk)) + selection_budget(share, approximate))
    assert stats.mode == "blend" and stats.recomputed_tokens == expected
    selected = stats.selected_positions
    assert selected and min(selected) >= exact  # the exact prefix is never recomputed
    if share is not None:  # each pool gets its own budget, chosen among its tokens
        assert sum(exact <= p < m for p in selected) == selection_budget(share, approximate)
    assert stats.prefix_tokens == m and stats.approximate_prefix_tokens == approximate
    assert stats.exact_tokens == exact and stats.exact_kv_tokens == exact
    assert stats.cached_tokens == m + len(new_chunk) and stats.fresh_tokens == len(question)
    assert stats.reused_tokens == stats.cached_tokens - expected
    as_is = engine.blend([hit, CachedSegment(new_chunk), FreshSegment(question)],
                         config=cfg.with_overrides(approximate_prefix_recompute_ratio=0.0))
    # Reused as is, the history takes no share and the chunks take approximate_prefix_chunk_factor times theirs.
    assert as_is.stats.recomputed_tokens == selection_budget(0.45, len(new_chunk))
    assert not torch.equal(out.logits, as_is.logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_approximate_prefix_at_ratio_one_is_full_prefill_and_at_zero_reused_as_is(arch):
    """At recompute_ratio 1.0 an approximate prefix is recomputed whatever its share: the same blend, bit for
    bit, as the turn's tokens from exact chunks (full prefill); at 0 it is reused as is (full reuse)."""
    engine = tiny_engine(arch)
    hit, new_chunk, question, lead = second_turn(engine)
    m, exact = len(hit), len(lead)
    _, chunk_ids, _, full_ids = prompt(engine)
    rest = [CachedSegment(c) for c in engine.prefill_chunks([list(hit.token_ids[exact:])])]
    for share in (0.0, 0.1, None):
        cfg = BlendConfig(recompute_ratio=1.0, approximate_prefix_recompute_ratio=share)
        a = engine.blend([hit, CachedSegment(new_chunk), FreshSegment(question)], config=cfg)
        b = engine.blend([hit.cut(exact), *rest, CachedSegment(new_chunk), FreshSegment(question)], config=cfg)
        assert torch.equal(a.logits, b.logits), share
        for layer in range(engine.num_layers):
            assert torch.equal(a.cache.layers[layer].keys, b.cache.layers[layer].keys)
            assert torch.equal(a.cache.layers[layer].values, b.cache.layers[layer].values)
        assert a.stats.recomputed_tokens == m - exact + len(new_chunk)
        assert a.stats.exact_kv_tokens == a.stats.total_tokens
        assert a.stats.prefix_tokens == m and a.stats.approximate_prefix_tokens == m - exact
        assert a.stats.exact_tokens == exact
    torch.testing.assert_close(a.logits, engine.full_prefill(full_ids + chunk_ids[2] + question).logits,
                               atol=1e-5, rtol=1e-5)
    reuse = engine.blend([hit, CachedSegment(new_chunk), FreshSegment(question)],
                         config=BlendConfig(recompute_ratio=0.0, approximate_prefix_recompute_ratio=0.5)).stats
    assert reuse.recomputed_tokens == 0 and reuse.exact_tokens == exact and reuse.approximate_prefix_tokens == m - exact


@pytest.mark.parametrize("value, message", [(1.5, "approximate_prefix_recompute_ratio=1.5 is out of range"),
                                            (-0.1, "approximate_prefix_recompute_ratio=-0.1"),
                                            ("high", "approximate_prefix_recompute_ratio='high' must be a number"),
                                            (float("nan"), "approximate_prefix_recompute_ratio=nan")])
def test_the_approximate_prefix_share_is_validated(value, message):
    with pytest.raises(ConfigError, match=message):
        BlendConfig(approximate_prefix_recompute_ratio=value)
    assert BlendConfig(approximate_prefix_recompute_ratio=None).approximate_prefix_recompute_ratio is None


@pytest.mark.parametrize("value, message", [(0.5, "approximate_prefix_chunk_factor=0.5 is out of range"),
                                            ("x", "approximate_prefix_chunk_factor='x' must be a number"),
                                            (float("nan"), "approximate_prefix_chunk_factor=nan")])
def test_the_new_chunks_factor_behind_an_approximate_prefix_is_validated(value, message):
    with pytest.raises(ConfigError, match=message):
        BlendConfig(approximate_prefix_chunk_factor=value)


def test_few_blendable_tokens_behind_a_cached_prefix_are_computed_fresh_behind_it():
    engine = tiny_engine("llama")
    lead, chunk_ids, question, full_ids = prompt(engine)
    cache = PrefixCache(1 << 24, block_size=16)
    cache.insert(lead, *rotated(engine, engine.prefill_chunk(lead)), engine.fingerprint)
    hit = cache.match(full_ids, engine.fingerprint)
    m = len(hit.token_ids)
    chunk = engine.prefill_chunk(chunk_ids[0])
    segments = [hit, FreshSegment(lead[m:]), CachedSegment(chunk), FreshSegment(question)]
    out = engine.blend(segments, config=BlendConfig(min_blend_tokens=len(chunk) + 1))
    assert out.stats.mode == "prefix_cached" and out.stats.exact_tokens == m and out.stats.cached_tokens == m
    assert "fewer than min_blend_tokens" in out.stats.fallback_reason
    torch.testing.assert_close(out.logits, engine.full_prefill(lead + chunk_ids[0] + question).logits,
                               atol=1e-5, rtol=1e-5)


def test_a_prefix_segment_must_open_the_prompt_and_fit_the_model():
    engine = tiny_engine("llama")
    lead, _, question, _ = prompt(engine)
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in zip(*rotated(engine, engine.prefill_chunk(lead[:16])))])
    with pytest.raises(BlendInputError, match="can only open the prompt"):
        engine.blend([FreshSegment(question), PrefixSegment(lead[:16], kv), FreshSegment(question)])
    with pytest.raises(ChunkMismatchError, match="shaped"):
        engine.blend([PrefixSegment(lead[:16], kv[:, :, :, :8]), FreshSegment(question)])
    with pytest.raises(ChunkMismatchError, match="another model"):
        engine.blend([PrefixSegment(lead[:16], kv, "0" * 64), FreshSegment(question)])


def test_a_prefix_before_chunks_in_memory_and_in_a_store_keeps_every_chunk_in_its_place():
    from cacheblend_rag import StoredSegment
    from cacheblend_rag.store import ChunkCache

    engine = tiny_engine("qwen2")
    lead, chunk_ids, question, full_ids = prompt(engine)
    store = ChunkCache(engine)
    store.warm([chunk_ids[1]], lossless=True)
    cache = PrefixCache(1 << 24, block_size=16)
    cache.insert(lead, *rotated(engine, engine.prefill_chunk(lead)), engine.fingerprint)
    hit = cache.match(full_ids, engine.fingerprint)
    m = len(hit.token_ids)
    segments = [hit, FreshSegment(lead[m:]), CachedSegment(engine.prefill_chunk(chunk_ids[0])),
                StoredSegment(chunk_ids[1]), CachedSegment(engine.prefill_chunk(chunk_ids[2])), FreshSegment(question)]
    out = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0), store=store)
    assert out.stats.cache_hits == 3 and out.stats.exact_tokens == m
    torch.testing.assert_close(out.logits, engine.full_prefill(full_ids).logits, atol=1e-5, rtol=1e-5)
    reused = engine.blend(segments, config=BlendConfig(recompute_ratio=0.0), store=store)
    in_memory = [hit, FreshSegment(lead[m:]), *(CachedSegment(engine.prefill_chunk(c)) for c in chunk_ids),
                 FreshSegment(question)]
    torch.testing.assert_close(reused.logits, engine.blend(in_memory, config=BlendConfig(recompute_ratio=0.0)).logits,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_smollm2_turn_two_from_the_prefix_cache_is_full_prefill(smollm2_engine):
    """SmolLM2: a chat's second turn opens with the first turn's prompt and answer, kept from the
    decoding cache; at ratio 1.0 (and at 0.15, nothing being left to blend) the answer is full prefill's,
    and a hit blends bit for bit as the same K/V passed as an exact chunk."""
    from cacheblend_rag import ChunkKV
    from cacheblend_rag.config import GenerationConfig
    from cacheblend_rag.serving import AnnouncedChunks, BlendService
    from cacheblend_rag.store import ChunkCache

    engine = smollm2_engine
    cache = PrefixCache(1 << 28)
    service = BlendService(engine, ChunkCache(engine), AnnouncedChunks(8), cache)
    greedy = GenerationConfig(max_new_tokens=24, temperature=0.0)
    turn1 = [{"role": "system", "content": LEAD * 3}, {"role": "user", "content": "What is the capital of France?"}]
    render = lambda m: engine.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)  # noqa: E731
    first = service.generate(render(turn1), greedy, BlendConfig(recompute_ratio=1.0))
    turn2 = render(turn1 + [{"role": "assistant", "content": first.result.text},
                            {"role": "user", "content": "And what river flows through it?"}])
    prepared = service.prepare(turn2)
    hit = prepared.segments[0]
    assert isinstance(hit, PrefixSegment) and len(hit) >= len(engine.tokenize(render(turn1))) // 16 * 16
    ids = [t for s in prepared.segments for t in s.token_ids]
    full = engine.full_prefill(ids)
    for ratio in (1.0, 0.15):
        out = engine.blend(prepared.segments, config=BlendConfig(recompute_ratio=ratio))
        assert out.stats.exact_tokens == len(hit) and out.stats.fresh_tokens == len(ids) - len(hit)
        torch.testing.assert_close(out.logits, full.logits, atol=2e-4, rtol=1e-4)
    served = service.generate(turn2, greedy, BlendConfig(recompute_ratio=1.0))
    reference = engine.generate([FreshSegment(ids)], greedy)
    assert served.result.token_ids == reference.token_ids
    # The same K/V as an exact chunk blends bit for bit as the prefix segment does. Keys rotated back
    # and forward again are not the cache's bits, so both sides are built from the rotated-back chunk.
    a, m, kv = engine.adapter, len(hit), hit.kv
    cos, sin = a.rope_cos_sin(kv[0, 0][None], torch.arange(m).unsqueeze(0))
    raw = [a.apply_rope(kv[layer, 0][None], cos, -sin)[0] for layer in range(kv.shape[0])]
    chunk = ChunkKV(hit.token_ids, raw, [kv[layer, 1] for layer in range(kv.shape[0])])
    again = PrefixCache(1 << 28)
    again.insert(hit.token_ids, [a.apply_rope(k[None], cos, sin) for k in raw], [v[None] for v in chunk.values],
                 engine.fingerprint)
    rest = [FreshSegment(ids[m:])]
    x = engine.blend([again.match(ids, engine.fingerprint), *rest], config=BlendConfig(recompute_ratio=1.0))
    y = engine.blend([CachedSegment(chunk), *rest], config=BlendConfig(recompute_ratio=1.0))
    assert torch.equal(x.logits, y.logits)


def test_the_integrations_expose_and_validate_the_approximate_prefix_share():
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM

    engine = tiny_engine("llama")
    assert BlendConfig().approximate_prefix_recompute_ratio == 0.0
    llm = CacheBlendLLM.from_engine(engine, approximate_prefix_recompute_ratio=0.3)
    assert llm.blend_config.approximate_prefix_recompute_ratio == 0.3
    assert CacheBlendLLM.from_engine(engine, approximate_prefix_recompute_ratio=None).blend_config \
        .approximate_prefix_recompute_ratio is None
    with pytest.raises(ValueError, match="approximate_prefix_recompute_ratio"):
        CacheBlendLLM.from_engine(engine, approximate_prefix_recompute_ratio=2.0)
    chat = ChatCacheBlend(engine=engine, approximate_prefix_recompute_ratio=0.3)
    assert chat.blend_config.approximate_prefix_recompute_ratio == 0.3
