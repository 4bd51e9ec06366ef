"""The store key of authenticated mode: where it comes from, when one is required, and the one warning a
shared store opened without one gives.

Without a key every value ends with a checksum, which catches accidents (torn writes, bit rot), not
forgery: whoever can write the store (a Redis others reach, a folder others can write) can plant a
self-consistent entry, and every prompt that retrieves that chunk is answered from the planted K/V. So a
:class:`~cacheblend_rag.store.ChunkCache` on a shared store (anything but process memory:
:attr:`~cacheblend_rag.store.KVStore.shared`) without a key warns once per store opened, and
``require_store_key`` (``ChunkCache(require_key=True)``, ``serve --require-store-key``,
``warm --require-store-key``) refuses to start without one.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.backends.base import KVStore

logger = logging.getLogger(__name__)

STORE_KEY_ENV = "CACHEBLEND_STORE_KEY"
_HOW = (f"set a store key: store_key= in the integrations, auth_key= to ChunkCache, or ${STORE_KEY_ENV} (at least "
        "16 random bytes, e.g. `openssl rand -hex 32`), the same for every reader and writer of the store")

_warned: weakref.WeakSet[KVStore] = weakref.WeakSet()
_warned_lock = threading.Lock()


def store_key(auth_key: bytes | str | None) -> bytes | None:
    """The MAC key: ``auth_key`` (bytes, or text taken as UTF-8), else ``$CACHEBLEND_STORE_KEY``, else none."""
    key = auth_key if auth_key is not None else os.environ.get(STORE_KEY_ENV) or None
    if key is None:
        return None
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < 16:
        raise ConfigError(f"the store key ({'auth_key' if auth_key is not None else '$' + STORE_KEY_ENV}) has "
                          f"{len(raw)} bytes; use at least 16 random bytes, e.g. `openssl rand -hex 32`")
    return raw


def require_store_key(has_key: bool, setting: str) -> None:
    """Raise :class:`ConfigError` unless there is a store key (``has_key``: :func:`store_key` found one) while
    ``setting`` (the option that asks for one, as the user spells it) requires it."""
    if not has_key:
        raise ConfigError(f"{setting} requires a store key and none is set: {_HOW}; or drop {setting} to run "
                          "without one (checksums only: anyone who can write the store can plant K/V that "
                          "steers the answers)")


def warn_if_keyless(store: KVStore, authenticated: bool) -> None:
    """Warn once per store object (not per request, nor per cache opened on it) that a shared store was opened
    without a key."""
    if authenticated or not store.shared:
        return
    with _warned_lock:
        if store in _warned:
            return
        _warned.add(store)
    logger.warning("KV store %s is shared and opened without a store key: anyone who can write it can plant "
                   "chunk K/V that steers the answers of every prompt retrieving that chunk (checksums catch "
                   "accidents, not forgery). To fix it, %s; require_store_key=True (serve --require-store-key) "
                   "refuses to start without one", store.describe(), _HOW)


__all__ = ["STORE_KEY_ENV", "require_store_key", "store_key", "warn_if_keyless"]
