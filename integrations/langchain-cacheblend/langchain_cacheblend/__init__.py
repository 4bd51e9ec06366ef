"""LangChain integration of cacheblend-rag: a chat model, a retriever hook and a retriever tool that reuse
chunk KV caches."""

from langchain_cacheblend._errors import CacheBlendContextOverflowError
from langchain_cacheblend.chat_models import ChatCacheBlend
from langchain_cacheblend.retrievers import CacheBlendRetriever
from langchain_cacheblend.tools import cacheblend_retriever_tool

__all__ = ["CacheBlendContextOverflowError", "CacheBlendRetriever", "ChatCacheBlend", "cacheblend_retriever_tool"]
