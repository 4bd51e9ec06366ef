"""Fixtures of the Redis store tests: a real redis-server for the session, a tiny engine, a corpus."""

from __future__ import annotations

import shutil

import pytest

from cacheblend_rag import BlendConfig

from redis_server import RedisClusterServers, RedisServer  # noqa: E402  (tests/store_redis is on sys.path under pytest)


def _require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed; `make test` installs it (apt-get install redis-server)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One server for the session; tests that kill a server start their own with ``fresh_redis_server``."""
    _require_redis_server()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server, emptied for this test."""
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url()


@pytest.fixture
def fresh_redis_server(tmp_path):
    """A server of this test's own, free to be killed and restarted."""
    _require_redis_server()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A three-master Redis Cluster for the session."""
    _require_redis_server()
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed; it comes with the redis-server package (`make test` installs it)")
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def engine():
    from cacheblend_rag.testing import tiny_engine

    return tiny_engine(config=BlendConfig(recompute_ratio=0.25, check_layer=1))
