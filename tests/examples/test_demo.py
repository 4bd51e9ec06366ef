"""``make demo``'s pipeline (examples/demo.py) end to end on a tiny random Llama."""

from __future__ import annotations

import pytest
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import MetadataMode
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendNodePostprocessor

from cacheblend_rag.testing import tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture
def llm(engine):
    return CacheBlendLLM.from_engine(engine, max_new_tokens=6)


@pytest.fixture
def embed_model():
    return MockEmbedding(embed_dim=32)


def test_demo_pipeline_with_a_tiny_model(llm, embed_model, tmp_path, capsys):
    from cacheblend_rag.data import load_demo_questions
    from demo import (  # examples/demo.py
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
    assert llm.service.announced.latest()[-1] == best  # most relevant chunk last, next to the question
    print_comparison(pairs)
    printed = capsys.readouterr().out
    assert "median TTFT: CacheBlend" in printed and "mean TTFT" not in printed  # a median, named as one
    assert plot_comparison(pairs, tmp_path / "chart.png").stat().st_size > 0
