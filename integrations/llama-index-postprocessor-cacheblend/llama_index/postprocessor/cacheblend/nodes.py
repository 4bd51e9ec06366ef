"""The text of a node as the query engine renders it into the prompt: one function for the
postprocessor, the ingestion step and ``cacheblend-rag warm`` (through the entry point
``cacheblend_rag.chunk_renderers: llamaindex``), so a warmed chunk is the text a query looks up."""

from __future__ import annotations

from typing import Any, Mapping

from llama_index.core.schema import BaseNode, MetadataMode, TextNode

from cacheblend_rag.serving import chunk_text


def node_chunk_text(node: BaseNode, metadata_mode: MetadataMode = MetadataMode.LLM) -> str:
    """The text of ``node`` as the query engine will render it (``MetadataMode.LLM``: with the
    metadata the LLM sees), in the serving layer's normal form (:func:`cacheblend_rag.serving.chunk_text`)."""
    return chunk_text(node.get_content(metadata_mode=metadata_mode))


def record_chunk_text(record: Mapping[str, Any]) -> str:
    """A JSONL record of ``cacheblend-rag warm`` as LlamaIndex renders the node it describes: the
    record holds ``text`` and optionally ``metadata`` and any other ``TextNode`` field
    (``excluded_llm_metadata_keys``, ``text_template``, ``metadata_template``, ``metadata_separator``);
    a node's own ``node.dict()`` is such a record. Other keys are ignored."""
    return node_chunk_text(TextNode.model_validate(dict(record)))
