"""Every backend honours the KVStore contract; memory and disk evict whole chunks; tiers promote and survive failures."""

from __future__ import annotations

import logging
import os
import sqlite3

import diskcache
import pytest

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import DiskKVStore, MemoryKVStore, TieredKVStore, open_store, parse_size
from cacheblend_rag.store.errors import CorruptEntryError, StoreError


@pytest.fixture(params=["memory", "disk", "tiered"])
def store(request, tmp_path):
    if request.param == "memory":
        s = MemoryKVStore()
    elif request.param == "disk":
        s = DiskKVStore(tmp_path / "kv")
    else:
        s = TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "kv"))
    yield s
    s.close()


def _write_chunk(store, key, write_id="w1", layers=3, size=5000):
    for layer in range(layers):
        store.put_layer(key, write_id, layer, bytes([layer]) * size)
    return store.add_manifest(key, f"manifest-{write_id}".encode())


def test_layers_and_manifest_round_trip(store):
    assert store.get_manifest("k") is None and not store.contains("k")
    assert _write_chunk(store, "k")
    assert store.contains("k") and store.get_manifest("k") == b"manifest-w1"
    assert store.get_layer("k", "w1", 2) == bytes([2]) * 5000
    assert store.get_layers([("k", "w1", 0), ("k", "w1", 7), ("k", "w2", 0)]) == [bytes([0]) * 5000, None, None]
    assert list(store.keys()) == ["k"]


def test_first_manifest_wins_and_the_loser_cleans_up(store):
    assert _write_chunk(store, "k", "w1")
    assert not _write_chunk(store, "k", "w2")
    store.delete_layers("k", "w2", 3)
    assert store.get_manifest("k") == b"manifest-w1"
    assert store.get_layer("k", "w2", 0) is None and store.get_layer("k", "w1", 0) is not None


def test_delete_removes_manifest_and_every_layer(store):
    _write_chunk(store, "k", "w1")
    store.put_layer("k", "orphan", 0, b"x" * 5000)
    assert store.delete("k")
    assert store.get_manifest("k") is None
    assert store.get_layer("k", "w1", 0) is None and store.get_layer("k", "orphan", 0) is None
    assert not store.delete("k")


def test_stats_and_counters(store):
    _write_chunk(store, "a")
    _write_chunk(store, "b")
    store.record(hits=3, misses=2, corrupt=1)
    stats = store.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.corrupt) == (2, 3, 2, 1)
    assert stats.bytes >= 2 * 3 * 5000
    with pytest.raises(ValueError, match="unknown counters"):
        store.record(bogus=1)
    store.clear()
    stats = store.stats()
    assert (stats.entries, stats.hits, stats.corrupt) == (0, 0, 0)


def test_memory_store_evicts_least_recently_used_whole_chunks():
    store = MemoryKVStore(max_bytes=3 * 3 * 1000 + 200)
    for key in "abc":
        _write_chunk(store, key, size=1000)
    assert set(store.keys()) == {"a", "b", "c"}
    store.get_manifest("a")  # a is now more recent than b
    _write_chunk(store, "d", size=1000)
    assert set(store.keys()) == {"a", "c", "d"}
    assert store.get_layer("b", "w1", 0) is None
    assert store.stats().evictions == 1


def test_disk_store_respects_size_limit_by_evicting_oldest_chunks(tmp_path):
    limit = 400_000
    store = DiskKVStore(tmp_path / "kv", size_limit=limit)
    for i in range(20):
        _write_chunk(store, f"k{i}", layers=4, size=10_000)
        assert store.volume() <= limit
    keys = set(store.keys())
    assert "k19" in keys and "k0" not in keys
    stats = store.stats()
    assert stats.evictions == 20 - stats.entries
    for key in keys:  # survivors are whole
        assert all(store.get_layer(key, "w1", i) is not None for i in range(4))


def test_disk_store_is_shared_between_instances_and_persists(tmp_path):
    with DiskKVStore(tmp_path / "kv") as a:
        _write_chunk(a, "k")
        a.record(hits=1)
    with DiskKVStore(tmp_path / "kv") as b:
        assert b.contains("k") and b.stats().hits == 1


def test_disk_store_never_unpickles(tmp_path):
    store = DiskKVStore(tmp_path / "kv")
    with diskcache.Cache(str(tmp_path / "kv")) as raw:
        raw.set("m:evil", {"not": "bytes"})  # pickled by diskcache
        raw.set("l:evil:w:0", ["pickled"] * 10_000)  # large: a pickle file
    for read in (lambda: store.get_manifest("evil"), lambda: store.get_layer("evil", "w", 0)):
        with pytest.raises(CorruptEntryError, match="unpickle"):
            read()
    with pytest.raises(TypeError, match="bytes only"):
        store._cache.set("x", ["not", "bytes"])


class _Detonates:
    """A pickle whose loading makes a folder: proof that something unpickled it (harmless, and visible)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_planted_pickle_is_refused_and_never_loaded(tmp_path):
    """diskcache's pickle advisory (CVE-2025-69872, docs/dependencies.md) does not reach this store: a pickle
    another program plants in its folder, in the index and as a value file, is refused by every read and is
    never loaded; the same rows read through diskcache's default Disk would run it (the last lines)."""
    marker, path = tmp_path / "unpickled", tmp_path / "kv"
    DiskKVStore(path).close()
    with diskcache.Cache(str(path)) as raw:  # diskcache's own Disk pickles what is not bytes
        raw.set("m:evil", _Detonates(marker))
        raw.set("l:evil:w:0", [_Detonates(marker), b"x" * 200_000])  # large: a value file
        assert any(path.rglob("*.val"))
    with DiskKVStore(path) as store:
        for read in (lambda: store.get_manifest("evil"), lambda: store.get_layer("evil", "w", 0),
                     lambda: store.get_manifests(["evil"]), lambda: store.get_layers([("evil", "w", 0)])):
            with pytest.raises(CorruptEntryError, match="unpickle"):
                read()
        store.contains("evil"), list(store.keys()), store.volume(), store.stats()
        _write_chunk(store, "fine")  # writes beside the planted rows
        assert store.get_layer("fine", "w1", 0) == bytes([0]) * 5000
    assert not marker.exists(), "the store unpickled a planted value"
    with diskcache.Cache(str(path)) as raw:  # the payload is live: an ordinary diskcache loads it
        raw.get("m:evil")
    assert marker.exists()


def test_disk_store_wraps_io_errors(tmp_path, monkeypatch):
    store = DiskKVStore(tmp_path / "kv")

    def readonly(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(store._cache, "set", readonly)
    with pytest.raises(StoreError, match="readonly"):
        store.put_layer("k", "w", 0, b"x")


def test_disk_store_that_cannot_be_created_fails_clearly(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot open the disk KV store"):
        DiskKVStore(blocker / "kv")


def test_tiered_store_promotes_on_hit(tmp_path):
    disk = DiskKVStore(tmp_path / "kv")
    _write_chunk(disk, "k")
    memory = MemoryKVStore()
    tiered = TieredKVStore(memory, disk)
    assert tiered.get_manifest("k") == b"manifest-w1"
    assert memory.get_manifest("k") == b"manifest-w1"
    assert memory.get_layer("k", "w1", 1) is None
    assert tiered.get_layer("k", "w1", 1) == bytes([1]) * 5000
    assert memory.get_layer("k", "w1", 1) == bytes([1]) * 5000


def test_tiered_store_writes_through_and_the_slowest_tier_decides(tmp_path):
    memory, disk = MemoryKVStore(), DiskKVStore(tmp_path / "kv")
    _write_chunk(disk, "k", "other")
    tiered = TieredKVStore(memory, disk)
    assert not _write_chunk(tiered, "k", "mine")
    assert _write_chunk(tiered, "j", "mine")
    assert disk.get_manifest("j") == b"manifest-mine" and memory.get_manifest("j") == b"manifest-mine"


class _BrokenStore(MemoryKVStore):
    def __getattribute__(self, name):
        if name in {"get_layer", "put_layer", "get_manifest", "add_manifest", "contains", "delete", "delete_layers"}:
            raise StoreError("disk is on fire")
        return super().__getattribute__(name)


def test_tiered_store_skips_a_failing_tier_with_one_warning(caplog):
    memory = MemoryKVStore()
    tiered = TieredKVStore(memory, _BrokenStore())
    with caplog.at_level(logging.WARNING):
        for key in "abc":
            assert _write_chunk(tiered, key)
            assert tiered.get_layer(key, "w1", 0) is not None
    assert sum("is failing" in r.message for r in caplog.records) == 1
    with pytest.raises(StoreError, match="every tier"):
        TieredKVStore(_BrokenStore(), _BrokenStore()).put_layer("k", "w", 0, b"x")


def test_open_store_specs(tmp_path):
    assert isinstance(open_store(None), MemoryKVStore)
    assert open_store("memory:1KB").max_bytes == 1000
    assert isinstance(open_store(str(tmp_path / "a")), DiskKVStore)
    assert open_store(f"disk:{tmp_path / 'b'}", size_limit="2MiB").size_limit == 2 * 2**20
    assert isinstance(open_store(f"tiered:{tmp_path / 'c'}"), TieredKVStore)
    assert isinstance(open_store(f"file://{tmp_path / 'd'}"), DiskKVStore)
    with pytest.raises(ConfigError, match="unknown scheme"):
        open_store("s3://bucket/kv")
    with pytest.raises(ConfigError, match="not understood"):
        open_store("memory:lots")
    with pytest.raises(ConfigError, match="max_bytes"):
        MemoryKVStore(max_bytes=0)


@pytest.mark.parametrize("text, size", [
    ("512MB", 512 * 10**6), ("2GiB", 2 * 2**30), (" 2 gb ", 2 * 10**9), ("2Gb", 2 * 10**9), (".5GB", 5 * 10**8),
    ("1.5MiB", 3 * 2**19), ("1e9", 10**9), ("1.5e3MB", 15 * 10**8), ("7", 7), ("5 b", 5), (4096, 4096), (1.5, 1),
])
def test_sizes_are_read_with_or_without_a_unit(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "", "-5", "1.GB", "2GB of it", "10MB/s", "1E9", "1e400", True])
def test_a_size_not_understood_says_how_to_write_one(text):
    with pytest.raises(ConfigError, match=r"size .* is not understood; .*\(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB\), "
                                          r"e\.g\. 512MB or 2GiB"):
        parse_size(text)


@pytest.mark.parametrize("spec, message", [
    ("redis:/localhost:6379", r"malformed redis URL: write redis://localhost:6379"),
    ("redis:localhost:6379", r"malformed redis URL: write redis://localhost:6379"),
    ("rediss:/cache.internal:6380/0", r"malformed rediss URL"),
    ("file:/var/kv", r"malformed file URL: write file://var/kv"),
    ("s3:/bucket/kv", r"unknown scheme 's3'"),
    ("disk:http:/kv", r"unknown scheme 'http'"),
    ("tiered:redis:/localhost:6379", r"malformed redis URL"),
    ("tiered:kv,redis:/localhost", r"malformed redis URL"),
])
def test_a_url_gone_wrong_is_an_error_not_a_folder(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message) as caught:
        open_store(spec)
    assert "accepted: a folder path" in str(caught.value) and "redis://" in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # no folder named after the typo


def test_folder_names_that_only_resemble_urls_still_open(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("./redis:/kv", "notes:2026", "C:/kv"):
        with open_store(spec) as store:
            assert isinstance(store, DiskKVStore)
