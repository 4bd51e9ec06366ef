"""A real server for tests and notebooks, in this process: the app ``cacheblend-rag serve`` runs, on uvicorn in a
thread on a free 127.0.0.1 port, stopped by its own shutdown call. The integrations' remote tests use it: the
same app and wire as the command, without a second torch import and model load per test module (the command
itself, as a subprocess, is tests/server/test_serve_command.py's)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from cacheblend_rag.server.app import create_app
from cacheblend_rag.server.background import ServerThread
from cacheblend_rag.server.options import ServerConfig


@contextmanager
def running_server(model: str = "tiny-qwen2", *, store: Optional[str] = "memory", api_key: Optional[str] = None,
                   **settings: Any) -> Iterator[ServerThread]:
    """A server of ``model`` (a ``tiny-*`` one for tests) with its chunk K/V in ``store``, taking ``api_key`` when
    given, ``settings`` further CacheBlendSettings fields; ``server.url`` once it answers ``/health`` with 200.
    The engine (shared with this process's other objects on the model) keeps its scheduler when it stops."""
    config = ServerConfig(model=model, store=store, settings=settings, api_key=api_key, close_on_shutdown=False)
    with ServerThread(create_app(config)) as server:
        yield server


__all__ = ["running_server"]
