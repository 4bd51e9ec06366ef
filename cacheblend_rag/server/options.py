"""What a server is started with, free of FastAPI so that ``cacheblend-rag serve --help`` and the CLI's
checks work where the ``[server]`` extra is not installed.

:class:`ServerConfig` names the model and store to load (in the background, once the socket is up, so that
``/health`` can say 503 while the model loads) and the HTTP side: the name the model is served under, the
API key, the body-size bound and the default answer length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME, cache_root

if TYPE_CHECKING:
    from cacheblend_rag.serving.settings import CacheBlendSettings

# OpenAI's clients leave max_tokens out; an answer then gets this many tokens, or the room left in the window.
DEFAULT_MAX_TOKENS = 256
# A request body may hold this many bytes per token of the context window, plus MAX_BODY_SLACK: JSON escapes,
# tool schemas and documents repeated in the messages stay well inside it, while a body no prompt of the window
# could come from is refused (413) before it is parsed.
BODY_BYTES_PER_TOKEN = 64
MAX_BODY_SLACK = 1024 * 1024
# Seconds uvicorn waits for running requests to finish on SIGINT/SIGTERM before it closes them.
DEFAULT_GRACEFUL_SHUTDOWN_S = 30


def default_store_path() -> str:
    """The disk store ``serve`` keeps chunk K/V in when ``--store`` is not given: the package's cache folder's
    ``chunks`` (``$CACHEBLEND_CACHE_DIR/chunks``, else ``~/.cache/cacheblend-rag/chunks``), so that a restarted
    server finds the chunks it computed before."""
    return str(cache_root() / "chunks")


@dataclass
class ServerConfig:
    """A server to load: ``model`` and ``store`` (any ``store_path`` spelling; ``None``: memory) with further
    :class:`~cacheblend_rag.serving.CacheBlendSettings` fields in ``settings`` (blend fields, ``device``,
    ``dtype``, ``reuse_chunk_kv``, ``max_queued_requests``, ``kv_budget_bytes``...), and the HTTP side."""

    model: str = DEFAULT_MODEL_NAME
    # Out of the repr: a store URL's password and the key (the settings loaded from it show the store masked).
    store: Optional[str] = field(default=None, repr=False)
    settings: dict[str, Any] = field(default_factory=dict)
    served_model_name: Optional[str] = None
    api_key: Optional[str] = field(default=None, repr=False)
    # None: BODY_BYTES_PER_TOKEN x the context window + MAX_BODY_SLACK, known once the model is loaded.
    max_body_bytes: Optional[int] = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    # Run a one-token request before /health says ok, so the first client does not pay for the first call.
    warmup: bool = True
    # Close the engine's scheduler at shutdown (settings the server loaded itself); False leaves it to whoever
    # else holds the engine in this process (one engine per model is shared by every settings object).
    close_on_shutdown: bool = True
    # This server's name among replicas behind one address: each chat completion's ``cacheblend`` stats and each
    # /v1/documents/warm answer then say ``"replica": replica_id``, so a client or a test can tell which one
    # answered (and whose caches it hit). None: no such key.
    replica_id: Optional[str] = None

    @property
    def name(self) -> str:
        """The model's name on the wire: ``served_model_name``, else ``model`` as given."""
        return self.served_model_name or self.model

    def load(self) -> "CacheBlendSettings":
        """Load the model and open the store (seconds; the server calls it in a background thread)."""
        from cacheblend_rag.serving.settings import CacheBlendSettings

        return CacheBlendSettings(model=self.model, store_path=self.store, **self.settings)

    def body_limit(self, context_window: int) -> int:
        """The largest request body accepted, in bytes (see :data:`BODY_BYTES_PER_TOKEN`)."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return BODY_BYTES_PER_TOKEN * context_window + MAX_BODY_SLACK


__all__ = ["DEFAULT_GRACEFUL_SHUTDOWN_S", "DEFAULT_MAX_TOKENS", "ServerConfig", "default_store_path"]
