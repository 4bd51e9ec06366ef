"""Whatever a store holds under our keys, no request fails and no answer changes.

Values of other types, random bytes and JSON, deeply nested manifests, NaN or infinite payloads
with valid checksums, truncations, keys of another Redis type: on every backend (memory, disk,
tiered, Redis) each is detected as corrupt, counted, deleted and recomputed, and the blend's
answer equals the healthy store's. Chunks are stored at 32 bits here so that a recomputed chunk
is bit-for-bit the stored one and "the same answer" means equal logits. In authenticated mode a
forged entry (a valid checksum, no MAC) is refused too, and an entry under another store key is
neither used nor deleted.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheblend_rag import BlendConfig
from cacheblend_rag.store import ChunkCache, DiskKVStore, MemoryKVStore, TieredKVStore
from cacheblend_rag.store.format.codec import codec_named
from cacheblend_rag.store.format.chunk_bytes import encode_layer, encode_manifest, peek_manifest, value_digest
from cacheblend_rag.store.inventory import inventory
from cacheblend_rag.store.format.tampering import layer_name, manifest_name, nested_manifest, write_as_another_program

BACKENDS = ["memory", "disk", "tiered", "redis"]
KEY = b"0123456789abcdef0123456789abcdef"
CONFIG = BlendConfig(recompute_ratio=0.25, check_layer=1)


class Backend:
    """A store of one kind, and a way to put any Python value where our entries live, as another
    program writing to the same memory, directory or Redis could."""

    def __init__(self, kind: str, tmp_path, redis_url: str | None) -> None:
        self.kind, self.tmp_path, self.redis_url = kind, tmp_path, redis_url
        self.store = self.open()

    def open(self):
        if self.kind == "memory":
            return MemoryKVStore()
        if self.kind == "disk":
            return DiskKVStore(self.tmp_path / "kv")
        if self.kind == "tiered":
            return TieredKVStore(MemoryKVStore(), DiskKVStore(self.tmp_path / "kv"))
        from cacheblend_rag.store.backends.redis_store import RedisKVStore

        return RedisKVStore(self.redis_url)

    def _put(self, name_of: Any, value: Any) -> None:
        """``name_of(store)`` is (memory entry slot) or the backend's key of the value."""
        tiers = self.store.tiers if self.kind == "tiered" else [self.store]
        for tier in tiers:
            if isinstance(tier, MemoryKVStore):
                entry_key, slot = name_of("memory", tier)
                entry = tier._entries[entry_key]
                if slot == "m":
                    entry.manifest = value
                else:
                    entry.layers[slot] = value
            elif isinstance(tier, DiskKVStore):
                name, tag = name_of("disk", tier)
                write_as_another_program(tier.path, name, value, tag)  # diskcache's own Disk: any type, pickles
            else:
                import redis

                hash_name, field = name_of("redis", tier)
                client = redis.Redis.from_url(self.redis_url)
                if field is None:  # a key of another Redis type under the chunk's name
                    client.delete(hash_name)
                    client.set(hash_name, value)
                else:
                    client.hset(hash_name, field, value)

    def manifest(self, key: str, value: Any) -> None:
        def name_of(kind, tier):
            return {"memory": (key, "m"), "disk": (manifest_name(key), key), "redis": (tier._hash(key) if kind == "redis"
                                                                                 else None, b"m")}[kind]
        self._put(name_of, value)

    def layer(self, key: str, write_id: str, index: int, value: Any) -> None:
        def name_of(kind, tier):
            return {"memory": (key, (write_id, index)), "disk": (layer_name(key, write_id, index), key),
                    "redis": (tier._hash(key) if kind == "redis" else None, f"{write_id}:{index}".encode())}[kind]
        self._put(name_of, value)

    def other_type(self, key: str) -> None:
        """A value that is not a chunk at all under the chunk's name: a Redis string, a pickled list."""
        if self.kind == "redis":
            self._put(lambda kind, tier: (tier._hash(key), None), "not a chunk")
        else:
            self.manifest(key, ["a", "pickled", "list"])


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    redis_url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    backend = Backend(request.param, tmp_path, redis_url)
    yield backend
    backend.store.close()


@pytest.fixture
def cache(backend, engine, chunk_ids):
    with ChunkCache(engine, backend.store, storage_dtype="float32") as cache:
        cache.warm(chunk_ids)
        yield cache


@pytest.fixture
def healthy(engine, stored_prompt):
    """The answer with every chunk computed fresh (what a healthy float32 store returns too)."""
    _, in_memory = stored_prompt
    return engine.blend(in_memory, config=CONFIG).logits


def _manifest(cache, key):
    return peek_manifest(cache.store.get_manifest(key))


def _with_layer(cache, backend, key, index, keys, values):
    """Replace layer ``index`` of the chunk by one encoding ``keys``/``values`` with a valid checksum,
    and its manifest by one that names it: damage no checksum can see."""
    manifest = _manifest(cache, key)
    blob = encode_layer(keys, values, codec_named("float32"))
    backend.layer(key, manifest.write_id, index, blob)
    digests = list(manifest.layer_digests)
    digests[index] = value_digest(blob)
    backend.manifest(key, encode_manifest(replace(manifest, layer_digests=tuple(digests))))


def _answer_is_healthy_and_the_entry_is_repaired(engine, cache, stored, healthy, corrupt_expected=True):
    result = engine.blend(stored, store=cache, config=CONFIG)
    cache.flush()
    torch.testing.assert_close(result.logits, healthy, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    if corrupt_expected:
        assert stats.corrupt >= 1
    again = engine.blend(stored, store=cache, config=CONFIG)
    assert again.stats.cache_hits == len(stored) - 2  # rewritten whole
    torch.testing.assert_close(again.logits, healthy, atol=1e-5, rtol=1e-5)
    inventory(cache.store)  # `cache stats` reads every manifest: it must not raise either


KINDS = ["str-manifest", "int-layer", "str-layer-file", "bytes-json-manifest", "nested-json-manifest",
         "nan-layer", "inf-layer", "truncated-layer", "other-type"]


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_values_are_corrupt_never_a_failure(engine, backend, cache, chunk_ids, stored_prompt, healthy, kind):
    stored, _ = stored_prompt
    key = cache.key_for(chunk_ids[1])
    manifest = _manifest(cache, key)
    h, n, d = manifest.layer_shape
    if kind == "str-manifest":
        backend.manifest(key, "a manifest? no")
    elif kind == "int-layer":
        backend.layer(key, manifest.write_id, 2, 12345)
    elif kind == "str-layer-file":
        backend.layer(key, manifest.write_id, 2, "x" * 10_000)  # diskcache keeps a text this long in a file
    elif kind == "bytes-json-manifest":
        backend.manifest(key, json.dumps({"key": key, "num_layers": 4}).encode())
    elif kind == "nested-json-manifest":
        backend.manifest(key, nested_manifest())
    elif kind in ("nan-layer", "inf-layer"):
        poison = torch.full((h, n, d), math.nan if kind == "nan-layer" else math.inf)
        _with_layer(cache, backend, key, 1, poison, poison)
    elif kind == "truncated-layer":
        backend.layer(key, manifest.write_id, 0, encode_layer(torch.ones(h, n, d), torch.ones(h, n, d),
                                                             codec_named("float32"))[:100])
    elif kind == "other-type":
        backend.other_type(key)
    _answer_is_healthy_and_the_entry_is_repaired(engine, cache, stored, healthy)


def test_a_forged_entry_is_refused_in_authenticated_mode(engine, backend, chunk_ids, stored_prompt, healthy):
    """A writer without the key can make a consistent entry (valid checksums) that would steer the
    answer; with a store key the reader sees it was written without one and computes the chunk instead.
    Its checksum holds (a keyless replica's entry looks the same), so it is not this reader's to delete:
    it stays, counted as ``foreign_key_entries`` each time it is met (resident_bytes=0: not kept here)."""
    stored, _ = stored_prompt
    with ChunkCache(engine, backend.store, storage_dtype="float32", auth_key=KEY, resident_bytes=0) as signed:
        signed.warm(chunk_ids)
        key = signed.key_for(chunk_ids[1])
        forged = engine.prefill_chunk(chunk_ids[1])
        forged.values = [torch.zeros_like(v) for v in forged.values]  # what the attacker wants read
        signed.store.delete(key)
        with ChunkCache(engine, backend.store, storage_dtype="float32") as forger:
            assert forger.put(forged) > 0
            steered = engine.blend(stored, store=forger, config=CONFIG).logits
            assert not torch.allclose(steered, healthy)  # the threat: a checksum alone accepts it
        planted, before = signed.store.get_manifest(key), signed.stats()
        for _ in range(2):
            result = engine.blend(stored, store=signed, config=CONFIG)
            torch.testing.assert_close(result.logits, healthy, atol=1e-5, rtol=1e-5)
            assert (result.stats.cache_hits, result.stats.cache_misses) == (len(chunk_ids) - 1, 1)
        stats = signed.stats()
        assert stats.corrupt == before.corrupt and stats.foreign_key_entries == before.foreign_key_entries + 2
        assert signed.store.get_manifest(key) == planted  # never deleted, never used
        inventory(signed.store)


def test_a_reader_with_another_key_uses_no_entry_and_deletes_none(engine, backend, chunk_ids, stored_prompt,
                                                                   healthy):
    """Two deployments on one store with different keys, or a key changed on one replica: each one's entries
    are foreign to the other, skipped and counted, never deleted (they failed its MAC check and were deleted
    as corrupt, so a replica with a wrong key emptied the store of everyone else's entries)."""
    stored, _ = stored_prompt
    with ChunkCache(engine, backend.store, storage_dtype="float32", auth_key=KEY) as signed:
        signed.warm(chunk_ids)
        keys = [signed.key_for(ids) for ids in chunk_ids]
        manifests = [signed.store.get_manifest(key) for key in keys]
        before = signed.stats()
        with ChunkCache(engine, backend.store, storage_dtype="float32", auth_key=b"another key, 16+ bytes",
                        resident_bytes=0) as other:
            for _ in range(2):
                result = engine.blend(stored, store=other, config=CONFIG)
                torch.testing.assert_close(result.logits, healthy, atol=1e-5, rtol=1e-5)
                assert result.stats.cache_misses == len(chunk_ids)  # a miss, computed fresh
            stats = other.stats()
        assert stats.corrupt == before.corrupt
        assert stats.foreign_key_entries == before.foreign_key_entries + 2 * len(chunk_ids)
        assert stats.hits + stats.misses + stats.load_failures == \
            before.hits + before.misses + before.load_failures + 2 * len(chunk_ids)  # the soak's identity holds
        assert [signed.store.get_manifest(key) for key in keys] == manifests
        assert engine.blend(stored, store=signed, config=CONFIG).stats.cache_hits == len(chunk_ids)


def test_a_reader_without_the_key_does_not_use_or_delete_authenticated_entries(engine, backend, chunk_ids,
                                                                                stored_prompt, healthy):
    stored, _ = stored_prompt
    with ChunkCache(engine, backend.store, storage_dtype="float32", auth_key=KEY) as signed:
        signed.warm(chunk_ids)
        with ChunkCache(engine, backend.store, storage_dtype="float32") as keyless:
            result = engine.blend(stored, store=keyless, config=CONFIG)
            keyless.flush()
            torch.testing.assert_close(result.logits, healthy, atol=1e-5, rtol=1e-5)
            stats = keyless.stats()
            assert result.stats.cache_misses == len(chunk_ids) and stats.corrupt == 0
            assert stats.foreign_key_entries == len(chunk_ids)
        assert engine.blend(stored, store=signed, config=CONFIG).stats.cache_hits == len(chunk_ids)


VALUES = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100),
    st.integers(),
    st.floats(allow_nan=True),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                 max_leaves=20).map(lambda v: json.dumps(v).encode()),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=VALUES, where=st.sampled_from(["manifest", "layer-0", "layer-3"]))
def test_fuzz_any_value_under_a_valid_key_leaves_the_answer_unchanged(engine, backend, chunk_ids, stored_prompt,
                                                                      healthy, value, where):
    stored, _ = stored_prompt
    with ChunkCache(engine, backend.store, storage_dtype="float32") as cache:
        cache.warm(chunk_ids)
        key = cache.key_for(chunk_ids[0])
        if backend.kind == "redis" and not isinstance(value, (bytes, str, int, float)):
            value = repr(value)
        if where == "manifest":
            backend.manifest(key, value)
        else:
            backend.layer(key, _manifest(cache, key).write_id, int(where[-1]), value)
        result = engine.blend(stored, store=cache, config=CONFIG)
        cache.flush()
        torch.testing.assert_close(result.logits, healthy, atol=1e-5, rtol=1e-5)
        inventory(cache.store)
        cache.store.clear()
