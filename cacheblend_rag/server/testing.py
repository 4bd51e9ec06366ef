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

TINY_PREFIX = "tiny-"


@contextmanager
def running_server(model: str = "tiny-qwen2", *, store: Optional[str] = "memory", api_key: Optional[str] = None,
                   **settings: Any) -> Iterator[ServerThread]:
    """A server of ``model`` with its chunk K/V in ``store``, taking ``api_key`` when given, ``settings`` further
    CacheBlendSettings fields; ``server.url`` once it answers ``/health`` with 200.

    A ``tiny-*`` model gets an engine of its own, outside the process's registry, whose scheduler stops with the
    server: what the server holds never keeps alive, nor shares caches with, the engine the test process's other
    objects on that name use (a test that releases that engine finds it freed). Any other model loads as the
    command loads it (through the registry, its scheduler left running for the process's other objects)."""
    if model.startswith(TINY_PREFIX):
        from cacheblend_rag.serving import CacheBlendSettings
        from cacheblend_rag.serving.registry import tiny_engine_named

        loaded = CacheBlendSettings(engine=tiny_engine_named(model), store_path=store, **settings)
        try:
            with ServerThread(create_app(loaded, api_key=api_key)) as server:
                yield server
        finally:
            loaded.service.scheduler.close()
        return
    config = ServerConfig(model=model, store=store, settings=settings, api_key=api_key, close_on_shutdown=False)
    with ServerThread(create_app(config)) as server:
        yield server


__all__ = ["running_server"]
