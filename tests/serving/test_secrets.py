"""A store URL's password never shows (issue 69): not in a repr, a dump, a log line, an error, a store's
``describe()`` or a server's response; a dump loads back with it from ``$CACHEBLEND_STORE_PASSWORD``; the
user's spelling (``store_path="redis://:PASSWORD@host/0"``) still connects with it."""

from __future__ import annotations

import logging
import pickle

import httpx
import pytest
from pydantic import ValidationError

from cacheblend_rag.server import ServerConfig, ServerThread, create_app
from cacheblend_rag.server.errors import api_error
from cacheblend_rag.serving import CacheBlendSettings
from cacheblend_rag.store import open_store
from cacheblend_rag.store.urls import STORE_PASSWORD_ENV, is_masked, redact, redact_url, split_password, with_password
from cacheblend_rag.store.testing import record_store_opens
from cacheblend_rag.testing import tiny_engine

SECRET = "hunter2-s3cr3t"
CHUNKS = ["The Nile flows north through eleven countries into the Mediterranean Sea.",
          "Mount Kilimanjaro in Tanzania is the highest mountain in Africa."]


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The specs a ``secretdb://`` store was opened with (a memory store: no server needed)."""
    return record_store_opens(monkeypatch)


@pytest.mark.parametrize("spec, masked, password", [
    (f"redis://:{SECRET}@cache:6379/0", "redis://:***@cache:6379/0", SECRET),
    (f"rediss://app:{SECRET}@cache:6380/2?ssl_cert_reqs=none", "rediss://app:***@cache:6380/2?ssl_cert_reqs=none",
     SECRET),
    (f"tiered:/var/kv,redis://:{SECRET}@redis:6379/0?prefix=app", "tiered:/var/kv,redis://:***@redis:6379/0?prefix=app",
     SECRET),
    (f"redis://cache:6379/0?cluster=true&password={SECRET}", "redis://cache:6379/0?cluster=true&password=***", SECRET),
    ("redis://:p%40ss@cache/0", "redis://:***@cache/0", "p@ss"),  # percent-encoded: the password redis-py reads
    ("redis://:p@ss@cache/0", "redis://:***@cache/0", "p@ss"),  # "@" as written: up to the last one
    ("redis://app@cache/0", "redis://app@cache/0", None),
    ("redis://:***@cache/0", "redis://:***@cache/0", None),  # a dump's: the password is elsewhere
    ("/var/kv", "/var/kv", None),
    ("memory", "memory", None),
])
def test_every_spelling_is_split_and_put_back(spec, masked, password) -> None:
    assert split_password(spec) == (masked, password)
    assert SECRET not in redact(spec) and SECRET not in redact_url(spec) and "p@ss" not in redact(spec)
    assert is_masked(masked) == ("***" in masked)
    if password is not None:
        assert split_password(with_password(masked, password)) == (masked, password)


def test_free_text_loses_every_password_and_keeps_the_rest() -> None:
    text = (f"failed: {{'store_path': 'redis://:{SECRET}@h:1/0', 'url': \"https://bob:{SECRET}@proxy/v1\"}} "
            f"then redis:/:{SECRET}@h (malformed) and redis://h/0?password={SECRET}&db=1")
    shown = redact(text)
    assert SECRET not in shown
    assert "'redis://:***@h:1/0'" in shown and '"https://bob:***@proxy/v1"' in shown and "&db=1" in shown
    assert redact("redis://cache:6379/0 at 10:30@home") == "redis://cache:6379/0 at 10:30@home"


def test_a_url_without_a_password_takes_one() -> None:
    assert with_password("redis://cache:6379/0", "a b@c") == "redis://:a%20b%40c@cache:6379/0"
    assert with_password("redis://app@cache/0", "pw") == "redis://app:pw@cache/0"
    assert with_password(f"redis://:{SECRET}@cache/0", "other") == f"redis://:{SECRET}@cache/0"  # its own wins
    assert with_password("file:///var/kv", "pw") == "file:///var/kv" and with_password("/var/kv", "pw") == "/var/kv"


def test_settings_show_the_url_masked_and_open_it_with_the_password(opened, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    settings = CacheBlendSettings(engine=tiny_engine("llama"), store_path=f"secretdb://:{SECRET}@kv:1/0")
    assert opened == [f"secretdb://:{SECRET}@kv:1/0"]  # the store got the password
    assert settings.store_path == "secretdb://:***@kv:1/0"
    assert settings.store_password.get_secret_value() == SECRET
    settings.service.warm(CHUNKS, show_progress=False)
    for shown in (repr(settings), str(settings), str(settings.model_dump()), settings.model_dump_json(),
                  repr(settings.chunk_cache), settings.chunk_cache.store.describe(), caplog.text):
        assert SECRET not in shown
    assert "store_password" not in settings.model_dump()
    # A pickle keeps it (for the workers it is sent to), as it keeps store_key: its copy opens the same store.
    assert pickle.loads(pickle.dumps(settings)).store_password.get_secret_value() == SECRET


def test_a_dump_loads_back_with_the_password_from_the_environment(opened, monkeypatch) -> None:
    engine = tiny_engine("llama")
    dumped = CacheBlendSettings(engine=engine, store_path=f"secretdb://:{SECRET}@kv:2/0").model_dump()
    with pytest.raises(ValidationError, match=f"in place of its password.*\\${STORE_PASSWORD_ENV}") as refused:
        CacheBlendSettings(**dumped, engine=engine)
    assert SECRET not in str(refused.value)
    monkeypatch.setenv(STORE_PASSWORD_ENV, SECRET)
    loaded = CacheBlendSettings(**dumped, engine=engine)
    assert opened[-1] == f"secretdb://:{SECRET}@kv:2/0" and loaded.store_path == "secretdb://:***@kv:2/0"
    assert CacheBlendSettings(engine=engine, store_path="secretdb://kv:3/0").store_path == "secretdb://kv:3/0"
    assert opened[-1] == f"secretdb://:{SECRET}@kv:3/0"  # a URL without one takes the variable's too


def test_a_real_redis_is_reached_with_the_password(redis_server, redis_url, monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv(STORE_PASSWORD_ENV, raising=False)
    settings = CacheBlendSettings(engine=tiny_engine("llama"), store_path=redis_url)
    assert settings.service.warm(CHUNKS, show_progress=False).new == 2
    settings.chunk_cache.flush()
    assert settings.chunk_cache.stats().entries == 2
    shown = [repr(settings), settings.model_dump_json(), repr(settings.chunk_cache), str(settings.chunk_cache.stats()),
             caplog.text]
    assert not any(redis_server.password in text for text in shown)
    monkeypatch.setenv(STORE_PASSWORD_ENV, redis_server.password)
    bare = redis_url.replace(f":{redis_server.password}@", "")  # the password only in the environment
    assert open_store(bare).stats().entries == 2
    settings.chunk_cache.close()


def test_no_error_shows_the_password(redis_server, monkeypatch) -> None:
    monkeypatch.delenv(STORE_PASSWORD_ENV, raising=False)
    engine = tiny_engine("llama")
    wrong = redis_server.url(password=SECRET)
    from redis_server import free_port  # tests/store_redis, on sys.path under pytest

    failures = [  # each with a word of its message: the error still says what is wrong
        (lambda: CacheBlendSettings(engine=engine, store_path=wrong), "rejected the credentials"),
        (lambda: CacheBlendSettings(engine=engine, store_path=f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"),
         "cannot reach Redis at redis://:***@"),
        (lambda: CacheBlendSettings(engine=engine, store_path=f"redis:/:{SECRET}@127.0.0.1/0"), "malformed"),
        (lambda: CacheBlendSettings(engine=engine, store_path=f"redis://:{SECRET}@127.0.0.1:99999/0"), "port"),
        (lambda: CacheBlendSettings(engine=engine, store_path=f"redis://:{SECRET}@h/0", store_password="other"),
         "two different passwords"),
        # pydantic would quote every argument of a failed check (hide_input_in_errors keeps them out)
        (lambda: CacheBlendSettings(engine=engine, store_path=f"redis://:{SECRET}@h/0", profile_layers=0),
         "profile_layers=0"),
        (lambda: CacheBlendSettings(base_url="http://127.0.0.1:1", store_key=SECRET, api_key=SECRET,
                                    store_path=f"redis://:{SECRET}@h/0", max_announced_chunks=0), "max_announced"),
        (lambda: CacheBlendSettings(base_url=f"http://me:{SECRET}@127.0.0.1:1"), "api_key="),  # a key goes there
        (lambda: CacheBlendSettings(base_url=f"ftp://me:{SECRET}@127.0.0.1:1"), "http:// or https://"),
    ]
    for failing, word in failures:
        with pytest.raises(Exception) as raised:  # noqa: PT011 (what is checked is the message)
            failing()
        assert SECRET not in str(raised.value) and SECRET not in repr(raised.value), raised.value
        assert word in str(raised.value)


def test_the_server_never_shows_the_password(redis_server, redis_url, monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv(STORE_PASSWORD_ENV, raising=False)
    config = ServerConfig(model="tiny-llama", store=redis_server.url(password=SECRET), warmup=False,
                          close_on_shutdown=False)
    assert SECRET not in repr(config)
    server = ServerThread(create_app(config)).start(wait_ready=False)
    try:
        with pytest.raises(RuntimeError, match="rejected the credentials") as failed:
            server.wait_ready(120)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "rejected the credentials" in health.json()["error"]
        assert SECRET not in health.text and SECRET not in str(failed.value) and SECRET not in caplog.text
    finally:
        server.stop()
    error = api_error(RuntimeError(f"lost redis://:{SECRET}@h/0")).body()
    assert SECRET not in str(error) and "redis://:***@h/0" in error["error"]["message"]
    good = ServerConfig(model="tiny-llama", store=redis_url, warmup=False, close_on_shutdown=False)
    with ServerThread(create_app(good)) as serving:
        shown = [httpx.get(f"{serving.url}{path}").text for path in ("/health", "/v1/models", "/metrics")]
    assert not any(redis_server.password in text for text in [*shown, caplog.text])
