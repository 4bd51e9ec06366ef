"""How chunk K/V is stored as bytes: the self-describing per-layer values and manifest
(:mod:`~cacheblend_rag.store.format.chunk_bytes`), the storage codecs, content keys, the one validation path every
value read takes (:mod:`~cacheblend_rag.store.format.entries`), and damage as others could do it, for fault trials."""
