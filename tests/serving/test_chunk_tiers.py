"""Per request, which tier each chunk's K/V came from (``memory_hits``, ``chunk_tiers``): computed on a miss,
read from the store, or copied from the chunk cache's host-memory tier, on a tiny random model; and why, when the
store could not be read (``store_error``)."""

from __future__ import annotations

import pytest

from cacheblend_rag.kv.segments import StoredSegment
from cacheblend_rag.serving import CacheBlendSettings, ChatTurn, TurnEnd, run_turn
from cacheblend_rag.reuse.announced import AnnouncedChunks, chunk_tiers
from cacheblend_rag.store import ChunkCache, MemoryKVStore
from cacheblend_rag.store.errors import StoreError
from cacheblend_rag.testing import tiny_engine

DOCUMENTS = [{"title": f"Report {topic}", "text": f"The {topic} is described here at length, sentence after "
              f"sentence, with facts about {topic} and its history. " * 3}
             for topic in ("the river delta", "the mountain pass")]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def settings_on(engine, store_dir, resident_bytes: int = 64 << 20) -> CacheBlendSettings:
    """A fresh chunk cache (its own, empty host-memory tier) over the disk store in ``store_dir`` (or a store). No
    prefix or segment cache: every request below reads its chunks through the chunk cache."""
    cache = ChunkCache(engine, store_dir, resident_bytes=resident_bytes)
    return CacheBlendSettings(engine=engine, chunk_cache=cache, min_blend_tokens=0, prefix_cache_bytes=0,
                              segment_cache_bytes=0, temperature=0)


def stats_of(settings, question: str, **turn) -> dict:
    events = list(run_turn(settings, ChatTurn(generation=settings.generation_config_with(2, None, {}),
                                              messages=[{"role": "user", "content": question}],
                                              documents=DOCUMENTS, **turn)))
    assert isinstance(events[-1], TurnEnd)
    settings.chunk_cache.flush()  # the write-back and the host-memory copy run on the cache's writer thread
    return events[-1].stats


def test_chunks_are_computed_then_read_from_the_store_then_from_host_memory(engine, tmp_path):
    first = stats_of(settings_on(engine, tmp_path / "chunks"), "What do the reports say?")
    assert first["mode"] != "full_prefill"
    assert first["chunk_tiers"] == {"memory": 0, "store": 0, "computed": 2}
    assert first["cache_misses"] == 2 and first["memory_hits"] == 0
    assert first["store_error"] is None  # a miss is not a failure: the store answered

    # Another process's cache (an empty tier) on the same store: both chunks are store reads...
    other = settings_on(engine, tmp_path / "chunks")
    read = stats_of(other, "Which one is older?")
    assert read["chunk_tiers"] == {"memory": 0, "store": 2, "computed": 0}
    assert read["cache_hits"] == 2 and read["memory_hits"] == 0 and read["store_error"] is None
    # ...which that read kept in its host-memory tier, so its next request copies them from there.
    again = stats_of(other, "Which one is higher?")
    assert again["chunk_tiers"] == {"memory": 2, "store": 0, "computed": 0}
    assert again["cache_hits"] == again["memory_hits"] == 2


class DownStore(MemoryKVStore):
    """A store whose reads fail as a Redis that went away does, its error naming a URL with a password."""

    def get_manifests(self, keys):
        raise StoreError("cannot reach Redis at redis://:hunter2@10.0.0.9:6379/0?password=hunter2: refused")

    get_manifest = get_manifests


def test_an_answer_while_the_store_is_down_says_so_in_its_stats(engine):
    settings = settings_on(engine, DownStore(), resident_bytes=0)  # no host-memory tier to answer instead
    for question in ("What do the reports say?", "Which one is older?"):  # each request, not only the first
        stats = stats_of(settings, question)
        assert stats["chunk_tiers"] == {"memory": 0, "store": 0, "computed": len(DOCUMENTS)}
        assert stats["store_error"].startswith("cannot reach Redis at redis://:***@10.0.0.9:6379/0")
        assert "hunter2" not in stats["store_error"] and "computed fresh" in stats["store_error"]


def test_an_answer_while_redis_is_down_says_so_breaker_open_or_not(engine, fresh_redis_server):
    from cacheblend_rag.store.backends.redis_store import RedisKVStore

    url = fresh_redis_server.url()
    settings = settings_on(engine, RedisKVStore(url, probe_interval=60), resident_bytes=0)
    assert stats_of(settings, "What do the reports say?")["store_error"] is None  # computed, written back
    assert stats_of(settings, "Which one is older?")["chunk_tiers"]["store"] == 2
    fresh_redis_server.kill()
    first, during = (stats_of(settings, q) for q in ("Which one is higher?", "Which one is wider?"))
    for stats, why in ((first, "skipping it until a probe"), (during, "a probe checks it")):  # then breaker open
        assert stats["chunk_tiers"] == {"memory": 0, "store": 0, "computed": 2}
        assert f"Redis at redis://:***@127.0.0.1:{fresh_redis_server.port}/0 is unavailable" in stats["store_error"]
        assert why in stats["store_error"] and fresh_redis_server.password not in stats["store_error"]
    settings.chunk_cache.close()


def test_a_full_prefill_answer_reads_no_chunk(engine, tmp_path):
    stats = stats_of(settings_on(engine, tmp_path / "chunks"), "What do the reports say?", reuse=False)
    assert stats["mode"] == "full_prefill"
    assert stats["chunk_tiers"] == {"memory": 0, "store": 0, "computed": 0}


def test_chunks_computed_for_the_request_count_as_computed_not_as_hits():
    stats = {"cache_hits": 3, "memory_hits": 1, "cache_misses": 1, "load_failures": 0}
    stats["chunk_tiers"] = chunk_tiers(stats)
    assert stats["chunk_tiers"] == {"memory": 1, "store": 2, "computed": 1}
    announced = AnnouncedChunks(8)
    segments = [StoredSegment([1, 2]), StoredSegment([3, 4]), StoredSegment([5, 6])]
    announced.note_computed([[1, 2], [3, 4]])  # the retrieval side computed two of them for this request
    accounted = announced.account(stats, segments)
    assert accounted["cache_hits"] == 1 and accounted["precomputed_for_request"] == 2
    assert accounted["chunk_tiers"] == {"memory": 1, "store": 0, "computed": 3}
