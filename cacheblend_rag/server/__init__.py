"""The HTTP server, ``cacheblend-rag serve``: OpenAI's chat completions with documents per request, blended
from cached chunk K/V (docs/serving.md).

* :mod:`~cacheblend_rag.server.options`: :class:`ServerConfig`, what a server is started with (no FastAPI);
* :mod:`~cacheblend_rag.server.protocol`: the request bodies, pydantic models in OpenAI's shapes;
* :mod:`~cacheblend_rag.server.translate`: a request as a ``ChatTurn``, or a 400 naming the field;
* :mod:`~cacheblend_rag.server.responses`: completions, stream chunks, usage;
* :mod:`~cacheblend_rag.server.errors`: every failure as OpenAI's error body with its status;
* :mod:`~cacheblend_rag.server.state`: the model, loaded in the background, and the tokenizer requests count with;
* :mod:`~cacheblend_rag.server.completions`: one request run off the event loop, whole or streamed;
* :mod:`~cacheblend_rag.server.middleware`: the API key, the body bound, request counts;
* :mod:`~cacheblend_rag.server.metrics`: ``GET /metrics``;
* :mod:`~cacheblend_rag.server.app`: :func:`create_app`, the routes;
* :mod:`~cacheblend_rag.server.background`: a socket bound first, and :class:`ServerThread` for tests;
* :mod:`~cacheblend_rag.server.commands`: the ``serve`` command.

FastAPI, uvicorn and prometheus-client come with the ``[server]`` extra; this package's ``__init__`` and
``options`` and ``commands`` import none of them, so the CLI works without the extra.
"""

from __future__ import annotations

from typing import Any

from cacheblend_rag.server.options import ServerConfig, default_store_path


def __getattr__(name: str) -> Any:
    # Imported on use: the app needs the [server] extra.
    if name == "create_app":
        from cacheblend_rag.server.app import create_app

        return create_app
    if name == "ServerThread":
        from cacheblend_rag.server.background import ServerThread

        return ServerThread
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ServerConfig", "ServerThread", "create_app", "default_store_path"]
