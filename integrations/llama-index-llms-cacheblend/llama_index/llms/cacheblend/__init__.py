"""LlamaIndex LLM over the CacheBlend engine: ``from llama_index.llms.cacheblend import CacheBlendLLM``.

The retrieval side lives in :mod:`llama_index.postprocessor.cacheblend`
(``CacheBlendNodePostprocessor`` and the ingestion transform ``CacheBlendKVPrecompute``).
"""

from llama_index.llms.cacheblend.base import CacheBlendLLM

__all__ = ["CacheBlendLLM"]
