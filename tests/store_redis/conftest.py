"""Fixtures of the Redis store tests: a Redis Cluster, a tiny engine. The single server
(``redis_server``, ``redis_url``, ``fresh_redis_server``) is in tests/conftest.py, for every test."""

from __future__ import annotations

import shutil

import pytest

from cacheblend_rag import BlendConfig

from redis_server import RedisClusterServers  # noqa: E402  (tests/store_redis is on sys.path under pytest)
from conftest_redis import require_redis_server as _require_redis_server  # noqa: E402


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
