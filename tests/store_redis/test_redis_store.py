"""RedisKVStore against a real redis-server: the KVStore contract, visibility, TTLs, URLs and credentials."""

from __future__ import annotations

import pytest
import redis
import torch

from cacheblend_rag import FreshSegment, StoredSegment
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import ChunkCache, StoreError, open_store
from cacheblend_rag.store.format.chunk_bytes import Manifest, encode_manifest
from cacheblend_rag.store.backends.redis_store import RedisKVStore, model_namespace, redact_url

from redis_workers import QUESTION, corpus  # noqa: E402


def _manifest(key: str, write_id: str, num_layers: int = 3) -> bytes:
    return encode_manifest(Manifest(key=key, write_id=write_id, num_layers=num_layers, num_tokens=1, kv_heads=1,
                                    head_dim=1, codec="float16", group=0, layer_digests=("00" * 16,) * num_layers,
                                    nbytes=3, created=0.0))


def _store(url: str, **options) -> RedisKVStore:
    return RedisKVStore(url, namespace="tests", **options)


def test_a_chunk_is_visible_only_once_its_manifest_is_written(redis_url):
    store = _store(redis_url)
    for layer in range(3):
        store.put_layer("k", "w1", layer, bytes([layer]) * 10)
        assert not store.contains("k") and store.get_manifest("k") is None and list(store.keys()) == []
    assert store.add_manifest("k", _manifest("k", "w1"))
    assert store.contains("k") and list(store.keys()) == ["k"] and store.get_manifest("k") == _manifest("k", "w1")
    got = store.get_layers([("k", "w1", 2), ("k", "w1", 0), ("k", "w2", 0)])
    assert got == [bytes([2]) * 10, bytes([0]) * 10, None]


def test_the_first_complete_write_wins_and_the_loser_cleans_up(redis_url):
    store = _store(redis_url)
    for write_id in ("w1", "w2"):
        for layer in range(3):
            store.put_layer("k", write_id, layer, write_id.encode())
    assert store.add_manifest("k", _manifest("k", "w1"))
    assert not store.add_manifest("k", _manifest("k", "w2"))
    store.delete_layers("k", "w2", 3)
    assert store.get_layers([("k", "w1", 0), ("k", "w2", 0)]) == [b"w1", None]
    assert store.delete("k") and not store.delete("k")
    assert store.get_layer("k", "w1", 0) is None and list(store.keys()) == []


def test_a_manifest_whose_layers_are_gone_is_refused(redis_url):
    store = _store(redis_url)
    store.put_layer("k", "w1", 0, b"x")  # layers 1 and 2 never arrive (or were evicted)
    with pytest.raises(StoreError, match="lost layers"):
        store.add_manifest("k", _manifest("k", "w1"))
    assert not store.contains("k")


def test_pending_writes_expire_and_ttl_applies_once_complete(redis_server, redis_url):
    store = _store(redis_url, ttl=500, pending_ttl=60)
    store.put_layer("k", "w1", 0, b"x")
    with redis_server.client() as client:
        name = "cacheblend:tests:{k}"
        assert 0 < client.ttl(name) <= 60  # a writer that dies here leaves nothing for long
        for layer in (1, 2):
            store.put_layer("k", "w1", layer, b"x")
        store.add_manifest("k", _manifest("k", "w1"))
        assert 60 < client.ttl(name) <= 500
        forever = _store(redis_url, prefix="other")
        for layer in range(3):
            forever.put_layer("k", "w1", layer, b"x")
        forever.add_manifest("k", _manifest("k", "w1"))
        assert client.ttl("other:tests:{k}") == -1  # no ttl: kept until deleted or evicted by maxmemory
        assert sorted(client.keys("*{k}")) == [b"cacheblend:tests:{k}", b"other:tests:{k}"]


def test_namespaces_keep_models_and_prefixes_apart(redis_url):
    a, b = RedisKVStore(redis_url), RedisKVStore(redis_url + "?prefix=app2")
    a.bind_model("model-A")
    b.bind_model("model-A")
    assert a.namespace == b.namespace == model_namespace("model-A")
    for layer in range(3):
        a.put_layer("k", "w", layer, b"x")
    a.add_manifest("k", _manifest("k", "w"))
    a.record(hits=2)
    assert list(a.keys()) == ["k"] and list(b.keys()) == [] and b.counters()["hits"] == 0
    other_model = RedisKVStore(redis_url)
    other_model.bind_model("model-B")
    assert list(other_model.keys()) == []
    unbound = RedisKVStore(redis_url)  # what `cacheblend-rag cache stats --store redis://...` sees: every model
    assert list(unbound.keys()) == ["k"] and unbound.counters()["hits"] == 2 and unbound.stats().entries == 1
    unbound.clear()
    assert list(a.keys()) == [] and a.counters()["hits"] == 0


def test_layer_reads_are_one_pipelined_round_trip(redis_url, monkeypatch):
    store = _store(redis_url)
    for key in "abcdef":
        store.put_layer(key, "w", 0, key.encode())
    executed = []
    original = redis.client.Pipeline.execute

    def counted(self, *args, **kwargs):
        executed.append(len(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted)
    assert store.get_layers([(key, "w", 0) for key in "abcdef"]) == [key.encode() for key in "abcdef"]
    assert executed == [6]  # unbound (no model): the values alone
    executed.clear()
    store.max_value_bytes = 1 << 20  # bound (ChunkCache.bind_model): their sizes first, then the values
    assert store.get_layers([(key, "w", 0) for key in "abcdef"]) == [key.encode() for key in "abcdef"]
    assert executed == [6, 6]


@pytest.mark.parametrize("password,message", [("wrong", "rejected the credentials"), ("", "requires a password")])
def test_a_wrong_password_is_a_clear_error(redis_server, password, message):
    url = redis_server.url(password) if password else f"redis://127.0.0.1:{redis_server.port}/0"
    with pytest.raises(ConfigError, match=message) as info:
        open_store(url)
    assert "wrong" not in str(info.value)  # the password is never echoed


def test_an_acl_user_authenticates(redis_server, redis_url):
    with redis_server.client() as client:
        client.acl_setuser("replica", enabled=True, passwords=["+replica-pw"], keys=["cacheblend:*"],
                           commands=["+@all"])
    port = redis_server.port
    store = RedisKVStore(f"redis://replica:replica-pw@127.0.0.1:{port}/0", namespace="tests")
    store.put_layer("k", "w", 0, b"x")
    assert store.get_layer("k", "w", 0) == b"x"
    with pytest.raises(ConfigError, match="rejected the credentials"):
        RedisKVStore(f"redis://replica:nope@127.0.0.1:{port}/0")


@pytest.mark.parametrize("url,message", [
    ("http://127.0.0.1:6379", "unknown scheme"),
    ("redis://127.0.0.1:notaport/0", "port"),
    ("redis:///0", "names no host"),
    ("redis://127.0.0.1:6379/0?prefix=a:b", "prefix"),
    ("redis://127.0.0.1:6379/0?ttl=-5", "ttl"),
])
def test_a_misconfigured_url_is_a_clear_error(url, message):
    with pytest.raises(ConfigError, match=message):
        open_store(url)


def test_unknown_url_options_and_size_limits_are_refused(redis_server):
    with pytest.raises(ConfigError, match="option redis-py does not know"):
        open_store(redis_server.url() + "?colour=blue")
    with pytest.raises(ConfigError, match="maxmemory"):
        open_store(redis_server.url(), size_limit="1GB")


def test_an_unreachable_server_at_construction_says_so(redis_server):
    from redis_server import free_port

    url = f"redis://:pw@127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreError, match="cannot reach Redis"):
        open_store(url)
    store = RedisKVStore(url, check_connection=False, namespace="tests")  # a replica may start while Redis is down
    with pytest.raises(StoreError, match="unavailable"):
        store.get_manifest("k")


def test_tls_urls_and_redaction():
    store = RedisKVStore("rediss://user:secret@cache.example:6380/2?ssl_cert_reqs=none", check_connection=False)
    assert store._client.connection_pool.connection_class is redis.SSLConnection
    assert "secret" not in store.describe() and "user:***@cache.example:6380/2" in store.describe()
    assert redact_url("redis://:pw@[::1]:6379/0") == "redis://:***@[::1]:6379/0"


def test_a_blend_from_redis_equals_the_blend_from_memory(engine, redis_url):
    ids = [engine.tokenize(t) for t in corpus(4)]
    question = FreshSegment(engine.tokenize(QUESTION))
    cache = ChunkCache(engine, open_store(redis_url), storage_dtype="float32")
    assert cache.warm(ids).new == 4
    result = engine.blend([*(StoredSegment(i) for i in ids), question], store=cache)
    reference = engine.blend([*engine.prefill_chunks(ids), question])
    assert (result.stats.cache_hits, result.stats.cache_misses) == (4, 0)
    torch.testing.assert_close(result.logits, reference.logits, rtol=0, atol=1e-5)
    stats = cache.stats()
    assert stats.entries == 4 and stats.hits == 4 and stats.bytes > 0
    assert stats.details["namespace"] == model_namespace(engine.fingerprint)
    cache.close()


def test_a_replica_chain_opens_from_one_spec(redis_url, tmp_path):
    from cacheblend_rag.store import DiskKVStore, MemoryKVStore, TieredKVStore

    store = open_store(f"tiered:{tmp_path / 'kv'},{redis_url}?prefix=app")
    assert isinstance(store, TieredKVStore)
    assert [type(t) for t in store.tiers] == [MemoryKVStore, DiskKVStore, RedisKVStore]
    assert store.tiers[-1].prefix == "app"
    store.bind_model("model-A")
    assert store.tiers[-1].namespace == model_namespace("model-A")


def test_a_redis_store_without_a_key_is_warned_about_once(engine, redis_url, caplog, monkeypatch):
    import logging

    monkeypatch.delenv("CACHEBLEND_STORE_KEY", raising=False)
    store = RedisKVStore(redis_url)
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.store_key"):
        with ChunkCache(engine, store, storage_dtype="float32") as cache:
            ids = [engine.tokenize(t) for t in corpus(2)]
            cache.warm(ids)
            for _ in range(2):
                engine.blend([*(StoredSegment(i) for i in ids), FreshSegment(engine.tokenize(QUESTION))], store=cache)
        ChunkCache(engine, store, storage_dtype="float32").close()
        ChunkCache(engine, RedisKVStore(redis_url), auth_key="0123456789abcdef").close()  # with a key: quiet
    warnings = [r.getMessage() for r in caplog.records if "without a store key" in r.getMessage()]
    assert len(warnings) == 1 and "RedisKVStore(" in warnings[0]  # per store opened, not per request or cache
