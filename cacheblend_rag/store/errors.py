"""Errors of the KV store. Both are caught by :class:`~cacheblend_rag.store.ChunkCache`, which
answers the request by computing fresh instead; they only reach users who call a store directly."""

from __future__ import annotations

from typing import Any

from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.store.urls import redact


class StoreError(CacheBlendError, OSError):
    """A store could not be reached, read or written (missing permission, full disk, server down).

    ``warned`` is true when the store has already logged a warning about this failure, so
    callers that handle it need not warn again (one warning per outage, not per request).
    """

    warned: bool = False


class CorruptEntryError(CacheBlendError, ValueError):
    """Stored bytes are not a valid entry: bad magic, version, dtype, shape, length or checksum."""


def read_failure(exc: BaseException, store: Any) -> str:
    """What a request's ``store_error`` (:class:`~cacheblend_rag.engine.results.BlendStats`) says when its read of
    ``store`` raised ``exc``: the error's message (a :class:`StoreError` names its store, another ``OSError`` is
    given the store's ``describe()``), with every URL's password masked (:func:`~cacheblend_rag.store.urls.redact`)."""
    message = str(exc) if isinstance(exc, StoreError) else f"KV store {store.describe()} failed to read ({exc})"
    return f"{redact(message)}; its chunks were computed fresh"
