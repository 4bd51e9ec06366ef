"""The single-server Redis fixtures' helper, importable by tests/conftest.py and this folder."""

from __future__ import annotations

import shutil

import pytest


def require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed; `make test` installs it (apt-get install redis-server)")
