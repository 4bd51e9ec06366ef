"""Retriever tools whose nodes the :class:`~llama_index.llms.cacheblend.CacheBlendLLM` blends: agentic RAG,
where retrieved chunks arrive as tool results rather than in a query engine's prompt.

A ``RetrieverTool`` writes each node as ``node.get_content(MetadataMode.LLM)`` followed by a blank line;
the :class:`CacheBlendNodePostprocessor` among its ``node_postprocessors`` announces exactly that text
(and warms what the store lacks) when the tool runs, so the agent's next call finds every node
verbatim in the tool message and blends its cached KV, wherever the message stands in the
conversation. The separators and the chat template's tool turn around the nodes stay fresh text.
"""

from __future__ import annotations

from typing import List, Optional

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode
from llama_index.core.tools import RetrieverTool

from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend.base import CacheBlendNodePostprocessor


def cacheblend_retriever_tool(
    retriever: BaseRetriever,
    llm: CacheBlendLLM,
    *,
    name: Optional[str] = None,
    description: Optional[str] = None,
    node_postprocessors: Optional[List[BaseNodePostprocessor]] = None,
    show_progress: bool = False,
) -> RetrieverTool:
    """``RetrieverTool.from_defaults`` over ``retriever``, with a :class:`CacheBlendNodePostprocessor` for
    ``llm`` after ``node_postprocessors`` (rerankers and filters run first, so the nodes it announces are
    the ones the tool returns)."""
    if not isinstance(llm, CacheBlendLLM):
        raise TypeError(f"llm must be a CacheBlendLLM (the model that reads the tool's results), "
                        f"got {type(llm).__name__}")
    postprocessors = list(node_postprocessors or [])
    if any(isinstance(p, CacheBlendNodePostprocessor) for p in postprocessors):
        raise ValueError("node_postprocessors already holds a CacheBlendNodePostprocessor; this function adds "
                         "one for llm, so pass the others only (or build RetrieverTool yourself)")
    # RetrieverTool renders nodes with MetadataMode.LLM: the postprocessor announces that text.
    postprocessors.append(CacheBlendNodePostprocessor(llm=llm, metadata_mode=MetadataMode.LLM,
                                                      show_progress=show_progress))
    return RetrieverTool.from_defaults(retriever=retriever, node_postprocessors=postprocessors, name=name,
                                       description=description)


__all__ = ["cacheblend_retriever_tool"]
