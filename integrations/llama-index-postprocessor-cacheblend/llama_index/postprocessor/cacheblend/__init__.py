"""LlamaIndex retrieval-side pieces of CacheBlend.

- ``CacheBlendNodePostprocessor``: at query time, makes every retrieved node's KV ready
  and tells the :class:`~llama_index.llms.cacheblend.CacheBlendLLM` which chunk texts
  the prompt will contain.
- ``CacheBlendKVPrecompute``: an ``IngestionPipeline`` transformation that precomputes
  the KV of every node at index time (CacheBlend's offline step).
- ``cacheblend_retriever_tool``: a ``RetrieverTool`` with the postprocessor, for agents (agentic RAG:
  the nodes arrive in a tool message and are blended there).
"""

from llama_index.postprocessor.cacheblend.base import CacheBlendNodePostprocessor
from llama_index.postprocessor.cacheblend.ingestion import CacheBlendKVPrecompute
from llama_index.postprocessor.cacheblend.tools import cacheblend_retriever_tool

__all__ = ["CacheBlendKVPrecompute", "CacheBlendNodePostprocessor", "cacheblend_retriever_tool"]
