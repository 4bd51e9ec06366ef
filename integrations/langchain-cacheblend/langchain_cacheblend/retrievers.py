"""CacheBlendRetriever: wraps any retriever so the chat model can reuse the KV of what it retrieves."""

from __future__ import annotations

from typing import Any, Iterable

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever, RetrieverLike
from langchain_core.vectorstores import VectorStoreRetriever
from pydantic import ConfigDict, Field

from cacheblend_rag.serving import WarmSummary, run_in_thread
from langchain_cacheblend.chat_models import ChatCacheBlend


class CacheBlendRetriever(BaseRetriever):
    """Returns the wrapped retriever's documents unchanged, after making their KV ready.

    For each query it precomputes the KV of retrieved documents that are not cached
    yet and tells ``llm`` that the coming prompt may contain their ``page_content``
    verbatim (``format_docs`` that joins ``page_content`` does exactly that).

    .. code-block:: python

        llm = ChatCacheBlend()
        retriever = CacheBlendRetriever(retriever=vectorstore.as_retriever(), llm=llm)
        retriever.warm(all_documents)          # optional: precompute the whole corpus up front
        chain = (
            {"context": retriever | format_docs, "question": RunnablePassthrough()}
            | prompt | llm | StrOutputParser()
        )
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: RetrieverLike
    """The retriever (or any runnable from a query to documents) to wrap."""
    llm: ChatCacheBlend
    """The chat model that will read the documents."""
    show_progress: bool = False
    """Show a progress bar when a query's documents need precomputing."""
    k: int | None = Field(default=None, ge=1)
    """Return at most this many documents (the wrapped retriever's first ones); ``None``: all it returns.
    A call may pass its own ``k`` too (``invoke(query, k=3)``); a wrapped vector store retriever gets
    it as well, so it returns enough."""

    def warm(self, documents: Iterable[Document | str], *, show_progress: bool = True) -> WarmSummary:
        """Precompute the KV of documents (or texts) up front, e.g. the whole corpus."""
        return self.llm.warm(documents, show_progress=show_progress)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, kwargs = self._k(kwargs)
        documents = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)[:k]
        self.llm.warm(documents, show_progress=self.show_progress, for_request=True)
        return documents

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, kwargs = self._k(kwargs)
        documents = (await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()},
                                                  **kwargs))[:k]
        # Precomputing is model work: keep it off the event loop.
        await run_in_thread(self.llm.warm, documents, show_progress=self.show_progress, for_request=True)
        return documents

    def _k(self, kwargs: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
        """How many documents to return, and the wrapped retriever's keyword arguments (with ``k``
        if it takes one: a vector store retriever does)."""
        k = kwargs.pop("k", None) or self.k
        if k is not None and isinstance(self.retriever, VectorStoreRetriever):
            kwargs["k"] = k
        return k, kwargs
