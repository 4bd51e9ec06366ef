"""LlamaIndex integration: CacheBlendLLM, CacheBlendNodePostprocessor and CacheBlendKVPrecompute.

Real LlamaIndex pipelines (FAISS vector store, ingestion pipeline, query and chat
engines) over a tiny random model and a deterministic bag-of-words embedding, so
every answer is reproducible and the whole file runs in seconds.
"""

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
from llama_index.core.llms import ChatMessage
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendKVPrecompute, CacheBlendNodePostprocessor
from llama_index.vector_stores.faiss import FaissVectorStore
from pydantic import ValidationError

from cacheblend_rag import BlendConfig
from cacheblend_rag.engine import FreshSegment
from cacheblend_rag.errors import ConfigError, ModelLoadError
from cacheblend_rag.prompting import split_prompt, to_segments
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


# ----------------------------------------------------------------- ingestion
def test_ingestion_transform_stores_every_node(llm, embed_model):
    index = build_index(llm, embed_model)
    nodes = list(index.docstore.docs.values())
    assert len(nodes) == len(DOCUMENTS)
    for node in nodes:
        text = node.get_content(metadata_mode=MetadataMode.LLM).strip()
        assert llm.chunk_cache.contains(llm.engine.tokenize(text))


def test_ingestion_transform_has_a_stable_cache_key(llm):
    transform = CacheBlendKVPrecompute(llm=llm, show_progress=True)
    as_dict = transform.to_dict()
    assert "llm" not in as_dict
    assert llm.engine.fingerprint in as_dict["target"]
    other = CacheBlendLLM.from_engine(llm.engine)
    assert CacheBlendKVPrecompute(llm=other).target != transform.target  # another in-memory store


# ------------------------------------------------------------- query engine
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
    assert llm.last_stats["mode"] == "blend" and llm.last_stats["reused_tokens"] == 0

    split = split_prompt(llm.last_prompt, [n.get_content(metadata_mode=MetadataMode.LLM).strip()
                                           for n in index.docstore.docs.values()])
    token_ids = [t for s in to_segments(split, engine.tokenize) for t in s.token_ids]
    reference = engine.generate([FreshSegment(token_ids)], max_new_tokens=8)
    assert reference.stats.mode == "full_prefill"
    assert answer == reference.text


def test_answers_without_postprocessor_by_full_prefill(llm, embed_model):
    index = build_index(llm, embed_model)
    baseline = CacheBlendLLM.from_engine(llm.engine, max_new_tokens=6)
    index.as_query_engine(llm=baseline, similarity_top_k=2).query(QUESTION)
    stats = baseline.last_stats
    assert stats["mode"] == "full_prefill" and stats["chunks_found"] == 0
    assert "no announced chunk" in stats["fallback_reason"]


def test_reuse_off_is_plain_full_prefill(llm, embed_model):
    index = build_index(llm, embed_model)
    baseline = CacheBlendLLM.from_engine(llm.engine, chunk_cache=llm.chunk_cache, reuse_chunk_kv=False,
                                         max_new_tokens=6)
    answer = query_engine(index, baseline).query(QUESTION).response
    assert baseline.last_stats["mode"] == "full_prefill"
    assert "reuse_chunk_kv=False" in baseline.last_stats["fallback_reason"]
    reference = llm.engine.generate([llm.engine.tokenize(baseline.last_prompt)], max_new_tokens=6)
    assert answer == reference.text


# ----------------------------------------------------- streaming and async
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


def test_llm_streaming_and_async_apis_agree(llm):
    chunk = "Paris is the capital of France."
    llm.announce_chunks([chunk])
    prompt = f"Context:\n{chunk}\nQuestion: {QUESTION}\nAnswer:"
    sync = llm.complete(prompt)

    responses = list(llm.stream_complete(prompt))
    assert "".join(r.delta for r in responses) == sync.text == responses[-1].text
    assert responses[-1].additional_kwargs["mode"] == "blend"  # stats ride on the last delta

    messages = [ChatMessage(role="user", content=prompt)]
    chat = llm.chat(messages)

    async def run_async():
        completion = await llm.acomplete(prompt)
        chunks = [r.delta async for r in await llm.astream_complete(prompt)]
        achat = await llm.achat(messages)
        achat_chunks = [r async for r in await llm.astream_chat(messages)]
        return completion, "".join(chunks), achat, achat_chunks

    completion, streamed, achat, achat_chunks = asyncio.run(run_async())
    assert completion.text == streamed == sync.text
    assert achat.message.content == chat.message.content
    assert "".join(r.delta for r in achat_chunks) == chat.message.content
    assert achat_chunks[-1].additional_kwargs["chunks_found"] == 1


def test_async_does_not_block_the_event_loop(llm):
    chunk = "Paris is the capital of France."
    llm.announce_chunks([chunk])
    prompt = f"Context:\n{chunk}\nQuestion: {QUESTION}\nAnswer:"

    async def run() -> int:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await llm.acomplete(prompt, max_new_tokens=24)
        stop.set()
        await task
        return ticks

    assert asyncio.run(run()) > 1


# ------------------------------------------------------- prompt variations
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
    assert stats["mode"] == "full_prefill" and stats["fallback_reason"]
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
        assert all(call["chunks_found"] >= 1 and call["mode"] == "blend" for call in recorder.calls)
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


# ------------------------------------------------------------ postprocessor
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
    assert llm._announced.latest() == tuple(n.node.get_content(metadata_mode=MetadataMode.LLM).strip() for n in out)


def test_postprocessor_computes_missing_kv(llm, embed_model):
    index = build_index(llm, embed_model)
    fresh = CacheBlendLLM.from_engine(llm.engine)  # an empty store
    nodes = index.as_retriever(similarity_top_k=2).retrieve(QUESTION)
    CacheBlendNodePostprocessor(llm=fresh).postprocess_nodes(nodes, query_str=QUESTION)
    for n in nodes:
        assert fresh.chunk_cache.contains(fresh.engine.tokenize(n.node.get_content(metadata_mode=MetadataMode.LLM)))


def test_announced_chunks_are_bounded(engine):
    llm = CacheBlendLLM.from_engine(engine, max_announced_chunks=3)
    for i in range(10):
        llm.announce_chunks([f"chunk number {i}"])
    assert len(llm._announced) == 3
    assert llm._announced.known() == ["chunk number 7", "chunk number 8", "chunk number 9"]


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


# ---------------------------------------------------------- configuration
def test_metadata(llm, engine):
    meta = llm.metadata
    assert meta.is_chat_model is True  # the tiny tokenizer has a ChatML template
    assert meta.context_window == engine.context_window
    assert meta.num_output == 6
    assert meta.model_name == "tiny-llama"


def test_bad_store_path_fails_at_construction(engine, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValidationError, match=r"store_path=.*cannot be used as a chunk KV store"):
        CacheBlendLLM.from_engine(engine, store_path=str(blocker / "store"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("recompute_ratio", 1.5, r"recompute_ratio=1.5 is out of range; allowed range is \[0.0, 1.0\]"),
        ("recompute_ratio", -0.1, r"recompute_ratio=-0.1 is out of range"),
        ("selection", "nope", r"selection='nope' is not supported"),
        ("profile_layers", 0, r"profile_layers=0 is out of range"),
        ("profile_tokens", 0, r"profile_tokens=0 is out of range"),
        ("temperature", -1.0, r"temperature=-1.0 is out of range"),
        ("max_announced_chunks", 0, r"max_announced_chunks"),
        ("store_size_limit", "lots", r"size 'lots' is not understood"),
    ],
)
def test_bad_values_fail_at_construction(engine, field, value, message):
    with pytest.raises(ValidationError, match=message):
        CacheBlendLLM.from_engine(engine, **{field: value})


def test_profile_layers_reaches_the_blend_config(engine):
    assert CacheBlendLLM.from_engine(engine, profile_layers=2).blend_config.profile_layers == 2
    assert CacheBlendLLM.from_engine(engine).blend_config.profile_layers is None
    assert CacheBlendLLM.from_engine(engine, profile_tokens=5).blend_config.profile_tokens == 5
    assert CacheBlendLLM.from_engine(engine).blend_config.profile_tokens == BlendConfig().profile_tokens


def test_check_layer_beyond_the_model_fails(engine):
    with pytest.raises(ConfigError, match=r"check_layer=9 is out of range for a model with 4 layers"):
        CacheBlendLLM.from_engine(engine, check_layer=9)


def test_unknown_model_fails_at_construction(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying
    with pytest.raises(ModelLoadError, match="could not load model 'no-such-org/no-such-model'"):
        CacheBlendLLM(model="no-such-org/no-such-model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        CacheBlendLLM(model=str(tmp_path / "missing.gguf"))


def test_bad_configuration_does_not_load_the_model(monkeypatch):
    # Field validation runs before the (slow) model load.
    def fail(*args: Any, **kwargs: Any):
        raise AssertionError("the model should not be loaded")

    monkeypatch.setattr("cacheblend_rag.engine.CacheBlendEngine.from_pretrained", fail)
    with pytest.raises(ValidationError):
        CacheBlendLLM(recompute_ratio=2.0)


# ------------------------------------------------------------------- demo
def test_demo_pipeline_with_a_tiny_model(llm, embed_model, tmp_path, capsys):
    from cacheblend_rag.data import load_demo_questions
    from cacheblend_rag.demo import (
        MostRelevantLast, ask, build_faiss_index, demo_documents, minilm_folder, plot_comparison, print_comparison,
    )

    assert (minilm_folder() / "config.json").is_file()
    index = build_faiss_index(llm, embed_model, demo_documents(), show_progress=False)
    assert len(index.docstore.docs) == 20
    baseline = CacheBlendLLM.from_engine(llm.engine, reuse_chunk_kv=False, max_new_tokens=6)
    blended_engine = index.as_query_engine(
        llm=llm, similarity_top_k=3, node_postprocessors=[MostRelevantLast(), CacheBlendNodePostprocessor(llm=llm)]
    )
    full_engine = index.as_query_engine(llm=baseline, similarity_top_k=3)
    item = load_demo_questions()[0]
    pairs = [(ask(blended_engine, llm, item), ask(full_engine, baseline, item))]
    assert pairs[0][0].mode == "blend" and pairs[0][0].cache_hits == 3 and pairs[0][0].cache_misses == 0
    assert pairs[0][1].mode == "full_prefill"
    retrieved = index.as_retriever(similarity_top_k=3).retrieve(item.question)
    best = retrieved[0].node.get_content(metadata_mode=MetadataMode.LLM).strip()  # retrievers put it first
    assert llm._announced.latest()[-1] == best  # most relevant chunk last, next to the question
    print_comparison(pairs)
    printed = capsys.readouterr().out
    assert "median TTFT: CacheBlend" in printed and "mean TTFT" not in printed  # a median, named as one
    assert plot_comparison(pairs, tmp_path / "chart.png").stat().st_size > 0
