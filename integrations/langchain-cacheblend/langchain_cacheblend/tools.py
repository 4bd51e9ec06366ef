"""Retriever tools whose documents the chat model blends: agentic RAG, where retrieved chunks arrive as
tool results rather than in a prompt the chain builds.

Two ways the chat model learns which texts in a tool message are chunks:

- the tool's retriever is a :class:`~langchain_cacheblend.CacheBlendRetriever`: it warms and announces
  the documents when the tool runs (:func:`cacheblend_retriever_tool` builds such a tool);
- the tool answers with ``response_format="content_and_artifact"`` (``create_retriever_tool``'s option):
  the :class:`~langchain_core.messages.ToolMessage` carries the documents as its ``artifact``, and the
  chat model announces (and warms, where the store lacks them) the ones it was not told about when it
  renders the conversation (:func:`tool_result_documents`).

Either way each document's ``page_content`` is looked up verbatim in the rendered prompt, so whatever
the tool writes around it (``document_prompt``'s metadata lines, ``document_separator``, the chat
template's tool turn) stays fresh text and does not stop recognition.
"""

from __future__ import annotations

from typing import Literal

from langchain_core.prompts import BasePromptTemplate
from langchain_core.retrievers import RetrieverLike
from langchain_core.tools import StructuredTool, create_retriever_tool

from langchain_cacheblend._tool_results import tool_result_documents
from langchain_cacheblend.chat_models import ChatCacheBlend
from langchain_cacheblend.retrievers import CacheBlendRetriever


def cacheblend_retriever_tool(
    retriever: RetrieverLike,
    llm: ChatCacheBlend,
    name: str,
    description: str,
    *,
    k: int | None = None,
    document_prompt: BasePromptTemplate[str] | None = None,
    document_separator: str = "\n\n",
    response_format: Literal["content", "content_and_artifact"] = "content_and_artifact",
    show_progress: bool = False,
) -> StructuredTool:
    """``create_retriever_tool`` over ``retriever`` wrapped in :class:`CacheBlendRetriever` for ``llm``: when
    an agent calls the tool, the documents' KV is made ready and ``llm`` blends them in its next call.

    ``k``: return at most this many documents. ``response_format`` defaults to
    ``"content_and_artifact"``, so the tool message also carries the documents (for citations, and so a
    conversation replayed into a fresh process is still recognised). A ``document_prompt`` must keep
    ``{page_content}`` whole: that text is what the model finds and blends.
    """
    if not isinstance(llm, ChatCacheBlend):
        raise TypeError(f"llm must be a ChatCacheBlend (the model that reads the tool's results), "
                        f"got {type(llm).__name__}")
    if document_prompt is not None and "page_content" not in document_prompt.input_variables:
        raise ValueError(f"document_prompt has no {{page_content}} (it uses {document_prompt.input_variables}); "
                         "the document's text is what the model blends, so keep it in the prompt whole")
    if not isinstance(retriever, CacheBlendRetriever):
        retriever = CacheBlendRetriever(retriever=retriever, llm=llm, k=k, show_progress=show_progress)
    elif retriever.llm is not llm:
        raise ValueError("retriever is a CacheBlendRetriever for another ChatCacheBlend, so the documents would be "
                         "announced to that model; pass its inner retriever (retriever.retriever) or this llm's own")
    elif k is not None:
        retriever = retriever.model_copy(update={"k": k})
    return create_retriever_tool(retriever, name, description, document_prompt=document_prompt,
                                 document_separator=document_separator, response_format=response_format)


__all__ = ["cacheblend_retriever_tool", "tool_result_documents"]
