"""A server on a socket of its own: bound first (port 0 picks a free one), so its real address is known
before uvicorn starts, and, for tests and notebooks, run on a thread of this process and stopped by its own
shutdown call (:class:`ServerThread`), never by a signal to the process.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional

from cacheblend_rag.server.options import DEFAULT_GRACEFUL_SHUTDOWN_S
from cacheblend_rag.store.urls import redact


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one, read back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_server(app: Any, *, access_log: bool = False, log_level: str = "warning",
                   graceful_shutdown_s: Optional[int] = DEFAULT_GRACEFUL_SHUTDOWN_S) -> Any:
    """A ``uvicorn.Server`` for ``app``: lifespan on (the model loads there), access log off unless asked, and
    running requests given ``graceful_shutdown_s`` seconds to finish on shutdown."""
    import uvicorn

    config = uvicorn.Config(app, lifespan="on", access_log=access_log, log_level=log_level,
                            timeout_graceful_shutdown=graceful_shutdown_s)
    return uvicorn.Server(config)


class ServerThread:
    """uvicorn serving ``app`` on a thread, on ``host`` and a free port unless ``port`` is given.

    ``with ServerThread(create_app(settings)) as server: openai.OpenAI(base_url=server.base_url, ...)``; the
    ``with`` waits until the model answers (``GET /health`` 200) and stops the server at its end."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self.app = app
        self.socket = bind_socket(host, port)
        self.url = url_of(self.socket)
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn_server(app, **options)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name=f"cacheblend-server-{self.port}", daemon=True)

    @property
    def base_url(self) -> str:
        """What OpenAI's clients take as ``base_url``: the URL and ``/v1``."""
        return f"{self.url}/v1"

    def start(self, *, wait_ready: bool = True, timeout: float = 300.0) -> "ServerThread":
        """Start serving; with ``wait_ready``, return once the model is ready (raise if it failed to load)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        if wait_ready:
            self.wait_ready(max(0.0, deadline - time.monotonic()))
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        state = self.app.state.server
        deadline = time.monotonic() + timeout
        while not state.ready.wait(0.05):
            if state.error is not None:
                raise RuntimeError(redact(f"the model failed to load: {type(state.error).__name__}: {state.error}"))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server on {self.url} was not ready within {timeout} s ({state.status})")

    def stop(self, timeout: float = 60.0) -> None:
        """Ask uvicorn to shut down gracefully (as on SIGTERM) and wait for its thread."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.socket.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ServerThread", "bind_socket", "url_of", "uvicorn_server"]
