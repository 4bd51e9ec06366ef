"""Store helpers for tests (the store layer's own, so that tests of any layer above may use them)."""

from __future__ import annotations

from typing import Any

from cacheblend_rag.store.backends.memory import MemoryKVStore
from cacheblend_rag.store.schemes import SCHEMES
from cacheblend_rag.store.urls import STORE_PASSWORD_ENV


def record_store_opens(monkeypatch: Any, scheme: str = "secretdb") -> list[str]:
    """Register ``scheme://`` as a store that is a fresh memory store, and return the list of the specs it is
    opened with: for tests of what becomes of a store URL (its password) without a server to reach.
    ``$CACHEBLEND_STORE_PASSWORD`` is unset for the test. ``monkeypatch``: pytest's, which undoes both."""
    specs: list[str] = []

    def factory(spec: str, size_limit: Any = None, **options: Any) -> MemoryKVStore:
        specs.append(spec)
        return MemoryKVStore()

    monkeypatch.setitem(SCHEMES, scheme, factory)
    monkeypatch.delenv(STORE_PASSWORD_ENV, raising=False)
    return specs


__all__ = ["record_store_opens"]
