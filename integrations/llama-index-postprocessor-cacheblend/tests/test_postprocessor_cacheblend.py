"""The retrieval side on a tiny random Llama: CacheBlendKVPrecompute in an ingestion pipeline,
CacheBlendNodePostprocessor in query engines (every response mode) and chat engines, over FAISS."""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any, List

import faiss
import pytest
from llama_index.core import Document, PromptTemplate, StorageContext, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendKVPrecompute, CacheBlendNodePostprocessor
from llama_index.vector_stores.faiss import FaissVectorStore

from cacheblend_rag.engine import FreshSegment
from cacheblend_rag.store import ChunkCache
from cacheblend_rag.testing import tiny_engine

EMBED_DIM = 64
DOCUMENTS = [
    ("France", "Paris is the capital of France. The river Seine flows through Paris."),
    ("Curie", "Marie Curie was a physicist and chemist who won two Nobel prizes in Paris."),
    ("Amazon", "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean."),
    ("Fox", "The quick brown fox jumps over the lazy dog. The dog did not move."),
    ("Warsaw", "Marie Curie was born in Warsaw. Warsaw is the capital of Poland."),
]
QUESTION = "What is the capital of France?"


class HashEmbedding(BaseEmbedding):
    """Bag of words hashed into a fixed number of buckets: deterministic, offline, instant."""

    dim: int = EMBED_DIM

    def _vector(self, text: str) -> List[float]:
        vector = [0.0] * self.dim
        for word in re.findall(r"[a-z]+", text.lower()):
            bucket = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % self.dim
            vector[bucket] += 1.0
        norm = sum(v * v for v in vector) ** 0.5 or 1.0
        return [v / norm for v in vector]

    def _get_text_embedding(self, text: str) -> List[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)

class LLMStatsRecorder(BaseEventHandler):
    """Collects the blend stats of every LLM call through LlamaIndex instrumentation."""

    calls: List[dict] = []

    @classmethod
    def class_name(cls) -> str:
        return "LLMStatsRecorder"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response is not None:
            if event.response.additional_kwargs.get("mode"):
                self.calls.append(dict(event.response.additional_kwargs))

@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")

@pytest.fixture
def llm(engine):
    return CacheBlendLLM.from_engine(engine, max_new_tokens=6)

@pytest.fixture
def embed_model():
    return HashEmbedding()

@pytest.fixture
def recorder():
    handler = LLMStatsRecorder(calls=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)

def build_index(llm: CacheBlendLLM, embed_model: BaseEmbedding, *, metadata: bool = True) -> VectorStoreIndex:
    """FAISS index built by an ingestion pipeline that precomputes every node's KV."""
    documents = [
        Document(text=text, metadata={"title": title} if metadata else {}) for title, text in DOCUMENTS
    ]
    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=64, chunk_overlap=0),
            embed_model,
            CacheBlendKVPrecompute(llm=llm),
        ]
    )
    nodes = pipeline.run(documents=documents)
    vector_store = FaissVectorStore(faiss_index=faiss.IndexFlatL2(EMBED_DIM))
    storage = StorageContext.from_defaults(vector_store=vector_store)
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=embed_model)

def query_engine(index: VectorStoreIndex, llm: CacheBlendLLM, **kwargs: Any):
    kwargs.setdefault("similarity_top_k", 2)
    return index.as_query_engine(llm=llm, node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)], **kwargs)


def test_ingestion_transform_stores_every_node(llm, embed_model):
    index = build_index(llm, embed_model)
    nodes = list(index.docstore.docs.values())
    assert len(nodes) == len(DOCUMENTS)
    for node in nodes:
        text = node.get_content(metadata_mode=MetadataMode.LLM).strip()
        assert llm.chunk_cache.contains(llm.engine.tokenize(text))


def test_ingestion_transform_has_a_stable_cache_key(llm, tmp_path):
    transform = CacheBlendKVPrecompute(llm=llm, show_progress=True)
    as_dict = transform.to_dict()
    assert "llm" not in as_dict
    assert llm.engine.fingerprint in as_dict["target"]
    assert CacheBlendKVPrecompute(llm=CacheBlendLLM.from_engine(llm.engine)).target == transform.target  # one store
    other = CacheBlendLLM.from_engine(llm.engine, store_path=str(tmp_path / "kv"))
    assert CacheBlendKVPrecompute(llm=other).target != transform.target  # another store


def test_query_engine_reuses_precomputed_chunks(llm, embed_model):
    index = build_index(llm, embed_model)
    response = query_engine(index, llm).query(QUESTION)
    stats = llm.last_stats
    assert stats["mode"] == "blend"
    assert stats["chunks_found"] == 2 and stats["chunks_missing"] == 0
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0  # computed at ingestion
    assert stats["reused_tokens"] > 0 and stats["recomputed_tokens"] > 0
    assert stats["reused_tokens"] + stats["recomputed_tokens"] == stats["cached_tokens"]
    assert stats["ttft_s"] > 0
    assert isinstance(response.response, str)
    assert "Paris is the capital of France" in llm.last_prompt


def test_recompute_ratio_one_equals_full_prefill_of_the_same_prompt(engine, embed_model):
    llm = CacheBlendLLM.from_engine(engine, recompute_ratio=1.0, max_new_tokens=8)
    index = build_index(llm, embed_model)
    answer = query_engine(index, llm).query(QUESTION).response
    # Every cached token is recomputed; only an exact prefix (an earlier request's) is reused as is.
    assert llm.last_stats["mode"] == "blend" and llm.last_stats["reused_tokens"] == llm.last_stats["exact_tokens"]

    # Chunks keep the ids the whole prompt tokenizes to, so this is the plain model on the prompt.
    reference = engine.generate([FreshSegment(engine.tokenize(llm.last_prompt))], max_new_tokens=8)
    assert reference.stats.mode == "full_prefill"
    assert answer == reference.text


def test_answers_without_postprocessor_by_full_prefill(llm, embed_model):
    index = build_index(llm, embed_model)
    baseline = CacheBlendLLM.from_engine(llm.engine, max_new_tokens=6)
    index.as_query_engine(llm=baseline, similarity_top_k=2).query(QUESTION)
    stats = baseline.last_stats
    # An earlier request on this engine may have left the prompt's opening in the prefix cache.
    assert stats["mode"] in ("full_prefill", "prefix_cached") and stats["chunks_found"] == 0
    assert "no chunk text was announced" in stats["fallback_reason"]  # and how to fix it


def test_reuse_off_is_plain_full_prefill(llm, embed_model):
    index = build_index(llm, embed_model)
    baseline = CacheBlendLLM.from_engine(llm.engine, chunk_cache=llm.chunk_cache, reuse_chunk_kv=False,
                                         max_new_tokens=6)
    answer = query_engine(index, baseline).query(QUESTION).response
    assert baseline.last_stats["mode"] == "full_prefill"
    assert "reuse_chunk_kv=False" in baseline.last_stats["fallback_reason"]
    reference = llm.engine.generate([llm.engine.tokenize(baseline.last_prompt)], max_new_tokens=6)
    assert answer == reference.text


def test_streaming_and_async_give_the_sync_text(llm, embed_model):
    index = build_index(llm, embed_model)
    sync_text = query_engine(index, llm).query(QUESTION).response

    streamed = query_engine(index, llm, streaming=True).query(QUESTION)
    assert "".join(streamed.response_gen) == sync_text

    async def run_async() -> tuple[str, str]:
        response = await query_engine(index, llm).aquery(QUESTION)
        stream = await query_engine(index, llm, streaming=True).aquery(QUESTION)
        pieces = [piece async for piece in stream.async_response_gen()]
        return response.response, "".join(pieces)

    async_text, async_streamed = asyncio.run(run_async())
    assert async_text == sync_text
    assert async_streamed == sync_text


def test_metadata_in_node_text_still_hits(llm, embed_model):
    index = build_index(llm, embed_model, metadata=True)
    query_engine(index, llm).query(QUESTION)
    assert "title: France" in llm.last_prompt
    assert llm.last_stats["chunks_found"] == 2
    assert llm.last_stats["cache_misses"] == 0


def test_chunk_changed_by_template_reports_a_miss_and_still_answers(llm, embed_model):
    index = build_index(llm, embed_model)

    def shout_first_chunk(**kwargs: Any) -> str:
        first, glue, rest = kwargs["context_str"].partition("\n\n")
        return first.upper() + glue + rest

    template = PromptTemplate(
        "Context:\n{context_str}\nQuestion: {query_str}\nAnswer: ",
        function_mappings={"context_str": shout_first_chunk},
    )
    answer = query_engine(index, llm, text_qa_template=template).query(QUESTION).response
    stats = llm.last_stats
    assert stats["chunks_found"] == 1 and stats["chunks_missing"] == 1
    assert stats["mode"] == "blend"

    def shout_everything(**kwargs: Any) -> str:
        return kwargs["context_str"].upper()

    template = PromptTemplate(
        "Context:\n{context_str}\nQuestion: {query_str}\nAnswer: ", function_mappings={"context_str": shout_everything}
    )
    answer = query_engine(index, llm, text_qa_template=template).query(QUESTION).response
    stats = llm.last_stats
    assert stats["chunks_found"] == 0 and stats["chunks_missing"] == 2
    assert stats["mode"] in ("full_prefill", "prefix_cached") and stats["fallback_reason"]
    reference = llm.engine.generate([llm.engine.tokenize(llm.last_prompt)], max_new_tokens=6)
    assert answer == reference.text


def test_custom_prompt_template(llm, embed_model):
    index = build_index(llm, embed_model)
    template = PromptTemplate("Passages:\n{context_str}\n\nQ: {query_str}\nA:")
    query_engine(index, llm, text_qa_template=template).query(QUESTION)
    assert llm.last_prompt.count("Passages:") == 1
    assert llm.last_stats["chunks_found"] == 2 and llm.last_stats["mode"] == "blend"


def test_completion_model_path(engine, embed_model):
    llm = CacheBlendLLM.from_engine(engine, is_chat_model=False, max_new_tokens=6)
    assert not llm.metadata.is_chat_model
    index = build_index(llm, embed_model)
    query_engine(index, llm).query(QUESTION)
    assert "<|im_start|>" not in llm.last_prompt  # no chat template around a completion prompt
    assert llm.last_stats["chunks_found"] == 2


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize"])
def test_response_modes(llm, embed_model, recorder, mode):
    index = build_index(llm, embed_model)
    query_engine(index, llm, response_mode=mode, similarity_top_k=3).query(QUESTION)
    assert recorder.calls, "no LLM call recorded"
    if mode == "refine":
        assert len(recorder.calls) == 3  # one call per chunk, each finds its chunk
        # A call whose whole prompt an earlier ratio-1.0 request computed is served from the prefix cache.
        assert all(call["chunks_found"] >= 1 and call["mode"] in ("blend", "prefix_cached") for call in recorder.calls)
    else:
        assert sum(call["chunks_found"] for call in recorder.calls) >= 3
    assert all(call["cache_misses"] == 0 for call in recorder.calls)


def test_condense_plus_context_chat_engine(llm, embed_model, recorder):
    index = build_index(llm, embed_model)
    chat_engine = CondensePlusContextChatEngine.from_defaults(
        index.as_retriever(similarity_top_k=2),
        llm=llm,
        node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)],
        system_prompt="Answer from the context.",
    )
    chat_engine.chat(QUESTION)
    first = [c for c in recorder.calls if c["chunks_found"]]
    assert first and first[-1]["chunks_found"] == 2 and first[-1]["mode"] == "blend"

    recorder.calls.clear()
    streamed = chat_engine.stream_chat("And who was born in Warsaw?")  # condenses the history first
    text = "".join(streamed.response_gen)
    assert isinstance(text, str)
    assert any(c["chunks_found"] >= 1 for c in recorder.calls)


class ReverseOrder(BaseNodePostprocessor):
    """A stand-in reranker: reverses the nodes and changes their scores."""

    def _postprocess_nodes(self, nodes: List[NodeWithScore], query_bundle: QueryBundle | None = None):
        return [NodeWithScore(node=n.node, score=i / 10) for i, n in enumerate(reversed(nodes))]


def test_postprocessor_returns_nodes_unchanged_after_a_reranker(llm, embed_model):
    index = build_index(llm, embed_model)
    retrieved = index.as_retriever(similarity_top_k=3).retrieve(QUESTION)
    reranked = ReverseOrder().postprocess_nodes(retrieved, query_str=QUESTION)
    before = [(n.node.node_id, n.score) for n in reranked]
    out = CacheBlendNodePostprocessor(llm=llm).postprocess_nodes(reranked, query_str=QUESTION)
    assert [(n.node.node_id, n.score) for n in out] == before
    assert all(a is b for a, b in zip(out, reranked))
    assert llm.service.announced.latest() == tuple(n.node.get_content(metadata_mode=MetadataMode.LLM).strip() for n in out)


def test_postprocessor_computes_missing_kv(llm, embed_model):
    index = build_index(llm, embed_model)
    empty = ChunkCache(llm.engine, "memory", prefix_ids=llm.chunk_cache.prefix_ids)
    fresh = CacheBlendLLM.from_engine(llm.engine, chunk_cache=empty)
    nodes = index.as_retriever(similarity_top_k=2).retrieve(QUESTION)
    CacheBlendNodePostprocessor(llm=fresh).postprocess_nodes(nodes, query_str=QUESTION)
    for n in nodes:
        assert fresh.chunk_cache.contains(fresh.engine.tokenize(n.node.get_content(metadata_mode=MetadataMode.LLM)))


def test_disk_store_persists_chunk_kv_across_llms(engine, embed_model, tmp_path):
    store = tmp_path / "kv"
    writer = CacheBlendLLM.from_engine(engine, store_path=str(store), max_new_tokens=6)
    index = build_index(writer, embed_model)
    writer.chunk_cache.close()  # finish background writes

    reader = CacheBlendLLM.from_engine(engine, store_path=str(store), max_new_tokens=6)
    for node in index.docstore.docs.values():
        text = node.get_content(metadata_mode=MetadataMode.LLM).strip()
        assert reader.chunk_cache.contains(engine.tokenize(text))
    query_engine(index, reader).query(QUESTION)
    assert reader.last_stats["cache_hits"] == 2 and reader.last_stats["cache_misses"] == 0
    assert reader.last_stats["mode"] == "blend"
