"""The text of a node as the query engine renders it into the prompt."""

from __future__ import annotations

from llama_index.core.schema import BaseNode, MetadataMode

from cacheblend_rag.serving import chunk_text


def node_chunk_text(node: BaseNode, metadata_mode: MetadataMode = MetadataMode.LLM) -> str:
    """The text of ``node`` as the query engine will render it (``MetadataMode.LLM``: with the
    metadata the LLM sees), in the serving layer's normal form (:func:`cacheblend_rag.serving.chunk_text`)."""
    return chunk_text(node.get_content(metadata_mode=metadata_mode))
