"""The store URL schemes :func:`~cacheblend_rag.store.factory.open_store` knows, and how a backend adds one.

Apart from the factory so that a backend registering itself here never imports the factory,
which imports the backend by name on first use of its scheme.
"""

from __future__ import annotations

from typing import Callable

from cacheblend_rag.store.backends.base import KVStore

StoreFactory = Callable[..., KVStore]
SCHEMES: dict[str, StoreFactory] = {}


def register_store_scheme(scheme: str, factory: StoreFactory) -> None:
    """Make ``open_store("scheme://...")`` call ``factory(spec, **options)``."""
    SCHEMES[scheme.lower()] = factory
