"""A shared store opened without a store key says so, once per store; require_store_key refuses to start
without one (ChunkCache(require_key=True), the settings of both integrations, serve and warm)."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.serving import CacheBlendSettings
from cacheblend_rag.store import ChunkCache, DiskKVStore, MemoryKVStore, TieredKVStore
from cacheblend_rag.store.store_key import STORE_KEY_ENV

from kvstore_samples import TEXTS  # noqa: E402

KEY = "0123456789abcdef0123456789abcdef"
LOGGER = "cacheblend_rag.store.store_key"


def _keyless_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "without a store key" in r.getMessage()]


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch):
    monkeypatch.delenv(STORE_KEY_ENV, raising=False)


def test_a_shared_store_without_a_key_is_warned_about_once_per_store(engine, tmp_path, caplog):
    store = DiskKVStore(tmp_path / "kv")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with ChunkCache(engine, store) as cache:
            cache.warm(TEXTS)
            for _ in range(3):  # requests say nothing
                cache.load(engine.tokenize(TEXTS[0]))
        ChunkCache(engine, store).close()  # a second cache on the same store: no second warning
    (warning,) = _keyless_warnings(caplog)
    assert "anyone who can write it can plant chunk K/V that steers the answers" in warning
    assert "checksums catch accidents, not forgery" in warning
    assert f"store_key= in the integrations, auth_key= to ChunkCache, or ${STORE_KEY_ENV}" in warning
    assert "require_store_key=True" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ChunkCache(engine, TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "kv2"))).close()  # a new store
    assert len(_keyless_warnings(caplog)) == 1
    store.close()


def test_no_warning_with_a_key_or_for_process_memory(engine, tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ChunkCache(engine, MemoryKVStore()).close()  # no one else writes it
        ChunkCache(engine, DiskKVStore(tmp_path / "a"), auth_key=KEY).close()
        monkeypatch.setenv(STORE_KEY_ENV, KEY)
        ChunkCache(engine, DiskKVStore(tmp_path / "b")).close()
    assert _keyless_warnings(caplog) == []


def test_require_key_refuses_to_open_without_a_key(engine, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=rf"require_key=True requires a store key and none is set: .*\${STORE_KEY_ENV}"
                                          r".*openssl rand -hex 32"):
        ChunkCache(engine, str(tmp_path / "kv"), require_key=True)
    assert not (tmp_path / "kv").exists()  # refused before the store was opened
    ChunkCache(engine, str(tmp_path / "kv"), require_key=True, auth_key=KEY).close()
    monkeypatch.setenv(STORE_KEY_ENV, KEY)
    ChunkCache(engine, str(tmp_path / "kv"), require_key=True).close()


def test_the_setting_refuses_before_the_model_loads(engine, tmp_path, monkeypatch):
    with pytest.raises(ValidationError, match="require_store_key=True requires a store key and none is set"):
        CacheBlendSettings(model="not-a-model-that-exists", store_path=str(tmp_path / "kv"), require_store_key=True)
    with pytest.raises(ValidationError, match="require_store_key=True requires a store key"):
        CacheBlendSettings(engine=engine, chunk_cache=ChunkCache(engine, MemoryKVStore()), require_store_key=True)
    settings = CacheBlendSettings(engine=engine, store_path=str(tmp_path / "kv"), store_key=KEY, require_store_key=True)
    assert settings.chunk_cache.tagger.authenticated
    monkeypatch.setenv(STORE_KEY_ENV, KEY)
    assert CacheBlendSettings(engine=engine, store_path=str(tmp_path / "kv"),
                              require_store_key=True).chunk_cache.tagger.authenticated


def test_serve_and_warm_refuse_without_a_key(tmp_path, monkeypatch, capsys):
    from cacheblend_rag.cli import build_parser, main
    from cacheblend_rag.server.commands import _config

    parse = build_parser().parse_args
    with pytest.raises(ConfigError, match="--require-store-key requires a store key and none is set"):
        _config(parse(["serve", "--require-store-key"]))  # before the socket is bound and the model loads
    assert "require_store_key" not in _config(parse(["serve"])).settings
    corpus = tmp_path / "chunks.txt"
    corpus.write_text("One chunk.")
    with pytest.raises(ConfigError, match="--require-store-key requires a store key"):
        main(["warm", "--path", str(tmp_path / "kv"), "--model", "not-loaded", "--require-store-key", str(corpus)])
    monkeypatch.setenv(STORE_KEY_ENV, KEY)
    assert _config(parse(["serve", "--require-store-key"])).settings["require_store_key"] is True
