"""Errors of the KV store. Both are caught by :class:`~cacheblend_rag.store.ChunkCache`, which
answers the request by computing fresh instead; they only reach users who call a store directly."""

from __future__ import annotations

from cacheblend_rag.errors import CacheBlendError


class StoreError(CacheBlendError, OSError):
    """A store could not be reached, read or written (missing permission, full disk, server down).

    ``warned`` is true when the store has already logged a warning about this failure, so
    callers that handle it need not warn again (one warning per outage, not per request).
    """

    warned: bool = False


class CorruptEntryError(CacheBlendError, ValueError):
    """Stored bytes are not a valid entry: bad magic, version, dtype, shape, length or checksum."""
