"""CacheBlendNodePostprocessor: makes retrieved chunks' KV ready and tells the LLM to expect them."""

from __future__ import annotations

from typing import List, Optional

from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend.nodes import node_chunk_text


class CacheBlendNodePostprocessor(BaseNodePostprocessor):
    """Put it last in ``node_postprocessors`` (after any reranker or filter).

    For each retrieved node it takes the text the query engine will render into the
    prompt (``node.get_content(metadata_mode=MetadataMode.LLM)``), announces it to the
    :class:`CacheBlendLLM` and, with ``precompute_missing``, computes the KV of texts the
    store lacks (ideally none: :class:`CacheBlendKVPrecompute` did that at ingestion).
    The nodes come back unchanged, in the same order with the same scores.
    """

    llm: CacheBlendLLM = Field(description="The CacheBlendLLM that will answer the prompt.", exclude=True)
    metadata_mode: MetadataMode = Field(
        default=MetadataMode.LLM, description="How the query engine renders nodes; LLM for the built-in ones."
    )
    precompute_missing: bool = Field(
        default=True,
        description="Compute missing chunk KV here; False leaves it to the LLM, which computes it on the fly.",
    )
    show_progress: bool = Field(default=False, description="Show a progress bar while computing missing KV.")

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendNodePostprocessor"

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        texts = [node_chunk_text(n.node, self.metadata_mode) for n in nodes]
        self.llm.announce_chunks(texts)
        if self.precompute_missing:
            self.llm.warm(texts, announce=False, show_progress=self.show_progress, for_request=True)
        return list(nodes)
