"""Prompt K/V reuse, one room: where each span of a prompt's K/V comes from, and what a request leaves for the next.

- :mod:`~cacheblend_rag.reuse.plan`: the one call a request makes (:meth:`PromptReuse.plan
  <cacheblend_rag.reuse.plan.PromptReuse.plan>`: the prompt as segments, each span's K/V from the prefix cache, a
  chunk, the segment cache, or computed) and what it keeps after (:meth:`~cacheblend_rag.reuse.plan.PromptReuse.keep`);
- :mod:`~cacheblend_rag.reuse.prompt`: a rendered prompt split into chunks and fresh text, the conditioning prefix;
- :mod:`~cacheblend_rag.reuse.announced`: the chunk texts the retrieval side announced;
- :mod:`~cacheblend_rag.reuse.text`: text to token ids, documents' special-token strings as text (a floor of its own
  below the engine, which tokenizes with it);
- :mod:`~cacheblend_rag.reuse.prefix_cache`: K/V of prompt openings in token blocks (exact and approximate);
- :mod:`~cacheblend_rag.reuse.segment_cache`: K/V of recent spans after the chunks, blended like a chunk.

Nothing is imported here, so the engine's import of ``reuse.text`` pulls in nothing else.
"""
