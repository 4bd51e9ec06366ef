"""LangChain integration of cacheblend-rag: a chat model and a retriever hook that reuse chunk KV caches."""

from langchain_cacheblend.chat_models import ChatCacheBlend
from langchain_cacheblend.retrievers import CacheBlendRetriever

__all__ = ["CacheBlendRetriever", "ChatCacheBlend"]
