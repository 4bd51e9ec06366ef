"""The KV store backends, one per file behind one interface (:mod:`~cacheblend_rag.store.backends.base`), as LMCache
keeps its storage backends: memory, disk (with its index), tiered, Redis (with its connection and key layout).
``cacheblend_rag.store.open_store`` opens one from a path or URL."""
