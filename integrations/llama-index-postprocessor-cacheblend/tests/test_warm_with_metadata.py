"""``cacheblend-rag warm`` over JSONL records with metadata, then a LlamaIndex query over the same
texts as nodes with that metadata: every chunk is a store hit, the store is unchanged, and the
stats say so. What the postprocessor itself computes for a query is counted apart."""

from __future__ import annotations

import json

import pytest
from llama_index.core import MockEmbedding, VectorStoreIndex
from llama_index.core.schema import MetadataMode, TextNode
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendNodePostprocessor
from llama_index.postprocessor.cacheblend.nodes import node_chunk_text, record_chunk_text

from cacheblend_rag.cli import main as cli_main
from cacheblend_rag.store import open_store
from cacheblend_rag.store_commands import read_chunks
from cacheblend_rag.testing import save_tiny_model

RECORDS = [
    {"text": "Paris is the capital of France. The river Seine flows through Paris.", "metadata": {"topic": "France"}},
    {"text": "Marie Curie won two Nobel prizes in Paris.", "metadata": {"topic": "Curie", "page": 3}},
    {"text": "The Amazon flows through Brazil, Peru and Colombia.", "metadata": {"topic": "Amazon"}},
    {"text": "The quick brown fox jumps over the lazy dog.", "metadata": {"topic": "Fox"}},
]
TOP_K = 3


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    return path


def _entries(store: str) -> int:
    with open_store(store) as opened:
        return opened.stats().entries


def _query_engine(model_folder, store: str):
    # prefix_cache_bytes=0: the question asked again would come back from the prefix cache (the first
    # answer's approximate blocks), and this test counts what the second one reads from the store.
    llm = CacheBlendLLM(model=str(model_folder), store_path=store, max_new_tokens=3, min_blend_tokens=0,
                        prefix_cache_bytes=0)
    nodes = [TextNode(text=r["text"], metadata=r["metadata"]) for r in RECORDS]
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    engine = index.as_query_engine(llm=llm, similarity_top_k=TOP_K,
                                   node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])

    def ask() -> dict:
        engine.query("Who won two Nobel prizes?")
        llm.chunk_cache.flush()
        return llm.last_stats

    return ask


def test_warm_renders_metadata_as_llamaindex_does_and_every_chunk_is_a_store_hit(model_folder, corpus, tmp_path):
    store = str(tmp_path / "kv")
    assert cli_main(["warm", "--model", str(model_folder), "--path", store, "--no-progress", str(corpus)]) == 0
    assert _entries(store) == len(RECORDS)
    stats = _query_engine(model_folder, store)()
    assert stats["mode"] == "blend" and stats["chunks_found"] == TOP_K
    assert stats["cache_hits"] == TOP_K and stats["cache_misses"] == 0 and stats["precomputed_for_request"] == 0
    assert _entries(store) == len(RECORDS)  # nothing computed at query time


def test_what_the_postprocessor_computes_is_not_counted_as_a_store_hit(model_folder, corpus, tmp_path):
    # Warmed as LangChain renders them (text alone), the chunks are not what LlamaIndex renders:
    # the postprocessor computes them, and the stats say so instead of claiming store hits.
    store = str(tmp_path / "kv")
    assert cli_main(["warm", "--for", "langchain", "--model", str(model_folder), "--path", store, "--no-progress",
                     str(corpus)]) == 0
    ask = _query_engine(model_folder, store)
    stats = ask()
    assert stats["cache_hits"] == 0 and stats["cache_misses"] == 0 and stats["precomputed_for_request"] == TOP_K
    assert _entries(store) == len(RECORDS) + TOP_K
    # The next query finds them stored: store hits now.
    again = ask()
    assert again["cache_hits"] == TOP_K and again["precomputed_for_request"] == 0


def test_a_record_renders_as_its_node_with_every_template_field(tmp_path):
    record = {"text": "Warsaw is the capital of Poland.", "metadata": {"topic": "Warsaw", "file": "a.md"},
              "excluded_llm_metadata_keys": ["file"], "text_template": "[{metadata_str}]\n{content}",
              "metadata_template": "{key} = {value}", "metadata_separator": "; "}
    node = TextNode(**record)
    assert record_chunk_text(record) == node_chunk_text(node) == "[topic = Warsaw]\nWarsaw is the capital of Poland."
    assert record_chunk_text(node.dict()) == node_chunk_text(node)  # a node's own dict is a record too
    path = tmp_path / "nodes.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps({"text": "No metadata."}) + "\n", encoding="utf-8")
    assert list(read_chunks(path)) == [node.get_content(metadata_mode=MetadataMode.LLM), "No metadata."]
    assert list(read_chunks(path, "langchain")) == [record["text"], "No metadata."]
