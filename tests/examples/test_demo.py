"""``make demo``'s pipeline (examples/demo.py) end to end on a tiny random Llama."""

from __future__ import annotations

import pytest
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


@pytest.fixture(scope="module")
def embed_model():
    # The demo's own all-MiniLM-L6-v2 (offline): questions retrieve different chunks, as in the demo; a
    # constant mock embedding retrieves the same three for every question, which the prefix cache then holds.
    from demo import minilm_embedding  # examples/demo.py

    return minilm_embedding()


def test_demo_pipeline_with_a_tiny_model(llm, embed_model, tmp_path, capsys):
    from cacheblend_rag.data import load_demo_questions
    from demo import (  # examples/demo.py
        WARM_UP, MostRelevantLast, build_faiss_index, compare, demo_documents, plot_comparison, print_comparison,
    )

    index = build_faiss_index(llm, embed_model, demo_documents(), show_progress=False)
    assert len(index.docstore.docs) == 20
    baseline = CacheBlendLLM.from_engine(llm.engine, reuse_chunk_kv=False, max_new_tokens=6)
    blended_engine = index.as_query_engine(
        llm=llm, similarity_top_k=3, node_postprocessors=[MostRelevantLast(), CacheBlendNodePostprocessor(llm=llm)]
    )
    full_engine = index.as_query_engine(llm=baseline, similarity_top_k=3)
    first, second = load_demo_questions()[:2]
    # The warm-up question and a repeat are never timed: a repeat's whole prompt is in the prefix cache.
    pairs = compare(blended_engine, llm, full_engine, baseline, [first, WARM_UP, second, first])
    timed = [blended.question for blended, _ in pairs]
    assert timed == [first.question, second.question]
    for blended, full in pairs:
        assert blended.mode == "blend" and blended.cache_hits == 3 and blended.cache_misses == 0
        assert full.mode == "full_prefill" and full.fresh_tokens == full.prompt_tokens
        origins = blended.origins()
        assert sum(origins.values()) == blended.prompt_tokens
        # The chunks' K/V came from the chunk store; the prefix cache held at most the template's opening
        # (the warm-up left it), never the whole prompt as it would for a repeated question.
        assert origins["chunk store"] > 0 and blended.prefix_tokens < blended.prompt_tokens - blended.fresh_tokens
    retrieved = index.as_retriever(similarity_top_k=3).retrieve(second.question)
    best = retrieved[0].node.get_content(metadata_mode=MetadataMode.LLM).strip()  # retrievers put it first
    assert llm.service.announced.latest()[-1] == best  # most relevant chunk last, next to the question
    capsys.readouterr()
    print_comparison(pairs)
    printed = capsys.readouterr().out
    assert "median TTFT over 2 questions" in printed and "mean TTFT" not in printed  # a median, named as one
    by_origin = [line for line in printed.splitlines() if "by origin" in line]
    assert len(by_origin) == len(pairs) + 1  # a line per question and one in the summary, each naming every source
    for source in ("chunk store", "prefix cache", "earlier spans", "chunks computed on a miss", "fresh"):
        assert all(source in line for line in by_origin), source
    assert "recomputed" in printed and "from the chunk store" not in printed  # no single "reuse" share
    assert plot_comparison(pairs, tmp_path / "chart.png").stat().st_size > 0
