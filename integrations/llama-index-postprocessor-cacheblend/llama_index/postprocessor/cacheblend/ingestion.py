"""CacheBlendKVPrecompute: CacheBlend's offline step as an ``IngestionPipeline`` transformation."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from llama_index.core.bridge.pydantic import Field, model_validator
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from cacheblend_rag.serving import run_in_thread

from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend.nodes import node_chunk_text


class CacheBlendKVPrecompute(TransformComponent):
    """Computes and stores the KV cache of every node at index time; nodes pass through unchanged.

    >>> pipeline = IngestionPipeline(transformations=[
    ...     SentenceSplitter(), embed_model, CacheBlendKVPrecompute(llm=llm, show_progress=True)],
    ...     vector_store=vector_store)

    Put it after every transformation that changes node text or metadata, so the KV is
    computed for the text the query engine will render (``MetadataMode.LLM``).
    """

    llm: CacheBlendLLM = Field(description="The CacheBlendLLM whose model and store get the KV.", exclude=True)
    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM, description="How nodes will be rendered.")
    show_progress: bool = Field(default=False, description="Show a tqdm bar while computing KV.")
    # Part of the ingestion cache key (the llm is excluded from it): the same nodes going to
    # another model or store must run again.
    target: str = Field(default="", description="Model fingerprint and store; filled in automatically.")

    @model_validator(mode="after")
    def _fill_target(self) -> "CacheBlendKVPrecompute":
        if self.target and not self.llm.engine_attached:
            # Unpickled (IngestionPipeline's workers re-run __init__): the target came along, and the llm
            # loads its model when the transform first runs, not here.
            return self
        if self.llm.is_remote:  # the server's model and store (its key is no part of it)
            self.target = f"server:{self.llm.base_url.rstrip('/')}#{self.llm.model}"
            return self
        cache = self.llm.chunk_cache
        store = self.llm.store_path or f"memory:{id(cache):x}"
        # The conditioning prefix is part of every chunk key: another prefix must run again.
        prefix = hashlib.sha256(repr(cache.prefix_ids).encode()).hexdigest()[:16]
        self.target = f"{self.llm.engine.fingerprint}@{store}#{prefix}"
        return self

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendKVPrecompute"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        # Its own bar when asked for here, or when the pipeline shows its bars (IngestionPipeline.run passes it).
        show_progress = self.show_progress or bool(kwargs.get("show_progress"))
        self.llm.warm([node_chunk_text(n, self.metadata_mode) for n in nodes], announce=False, show_progress=show_progress)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await run_in_thread(self.__call__, nodes, **kwargs)
