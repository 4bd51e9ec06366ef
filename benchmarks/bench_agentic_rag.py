"""Agentic RAG on MuSiQue (issue 56): an agent's retriever tool returns passages in a tool message, and the
answering call's time to first token is compared blended, with blending off, and with plain full prefill
(prints JSON; ``--out`` writes it).

The loop, through the LangChain integration (``ChatCacheBlend`` with a retriever tool bound), one per
question: a system turn and the question; the model's first call (it writes the tool call; where it answers
instead, the call ``search_passages(query=<question>)`` is written for it and ``calls_by_model`` says how
often); the tool runs and returns the top ``--k`` of the question's own MuSiQue passages (each cut to
``--passage-tokens`` tokens, as the harness's ``--max-passage-tokens`` cuts them; ranked by word overlap
with the query); then the answering call, the one timed. Every passage's KV is precomputed before the
question, untimed, as an ingestion pipeline would have done.

The answering call, three ways, each its own ``ChatCacheBlend`` on one engine and chunk store (``CONFIGS``):

* ``blended``: the shipped default, the tool built with ``cacheblend_retriever_tool`` (its passages are
  recognised, read from the chunk store and blended), the earlier turns from the prefix cache;
* ``blending_off``: the same model and settings, the tool a plain ``create_retriever_tool``: nothing tells the
  model which text is a passage (what happened before issue 56), so the earlier turns come from the prefix
  cache and every passage token is computed;
* ``full_prefill``: ``reuse_chunk_kv=False``, the whole prompt computed.

Before each timed call the prefix and segment caches are emptied and the first call is made again (untimed),
so each call finds in the prefix cache exactly what an agent's second call finds: the first call's prompt
and answer. The configurations take turns, their order rotating from repeat to repeat. The TTFT is the
answering call's wall time from ``stream`` to its first chunk (its first and only token: ``max_tokens=1``),
rendering and the tool results' lookup included; ``call_s`` runs to the stream's end, which also waits for
the request's bookkeeping after its last token (its K/V kept in the prefix cache); ``service_ttft_s`` is the
response's own ``ttft_s`` (request submitted to first token).

Fidelity, as the harness reports it (:mod:`cacheblend_rag.bench.harness`): full prefill's greedy answer to
the very answering prompt (``--max-new-tokens``), its first ``--teacher-tokens`` tokens teacher-forced
through the blend the call runs (its own segments: the prefix cache's, the passages from the store) and
through full reuse of the same segments (ratio 0); KL(full prefill || method) per token, recovery
``1 - KL/KL(full reuse)``, top-1 agreement, and whether the blend's greedy answer equals full prefill's.

    .venv/bin/python benchmarks/bench_agentic_rag.py --out docs/data/agentic_rag_smollm2.json   # 6 questions x 3
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import operator
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import BaseTool, create_retriever_tool

from cacheblend_rag.bench.metrics import answers_match, gold_f1, recovery, token_kl, top1_agreement
from cacheblend_rag.bench.prompt import SYSTEM_INSTRUCTION, MusiqueExample, load_musique, passage_text
from cacheblend_rag.bench.report import git_info, machine_info
from cacheblend_rag.bench.requests import FullPrefillRequest, run_request, teacher_forced_logits
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.calibration.lookup import describe_config
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.serving import shared_engine
from cacheblend_rag.reuse.plan import PreparedPrompt
from langchain_cacheblend import ChatCacheBlend, cacheblend_retriever_tool

DEFAULT_DATA = "../shared/data/musique_dev.json"
TARGET = 3.0  # the must-show: blended at least 3x faster to first token than blending off
TOOL = "search_passages"
AGENT_SYSTEM = f"Search the passages with the {TOOL} tool first. {SYSTEM_INSTRUCTION}"
CONFIGS = ("blended", "blending_off", "full_prefill")
TOKEN_STATS = ("mode", "prompt_tokens", "prefix_tokens", "cached_tokens", "reused_tokens", "recomputed_tokens",
               "fresh_tokens", "chunks_found", "cache_hits", "cache_misses", "fallback_reason")


class OverlapRetriever(BaseRetriever):
    """The ``k`` documents sharing the most words with the query (ties in corpus order): offline, deterministic."""

    documents: list[Document]
    k: int

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        words = set(re.findall(r"\w+", query.lower()))
        scores = [len(words & set(re.findall(r"\w+", d.page_content.lower()))) for d in self.documents]
        order = sorted(range(len(self.documents)), key=lambda i: (-scores[i], i))
        return [self.documents[i] for i in order[: self.k]]


def corpus(engine: CacheBlendEngine, example: MusiqueExample, passage_tokens: int | None) -> list[Document]:
    """The question's passages as documents, each cut to ``passage_tokens`` tokens as the harness cuts them."""
    documents = []
    for title, text in example.passages:
        if passage_tokens is not None:
            text = engine.tokenizer.decode(engine.tokenize(text)[:passage_tokens])
        if (title + text).strip():
            documents.append(Document(page_content=passage_text(title, text).strip(), metadata={"title": title}))
    return documents


class PromptRecorder:
    """Keeps the prompt and segments of a model's latest call (its service's ``prepare``, wrapped)."""

    def __init__(self, llm: ChatCacheBlend) -> None:
        self.service = llm.service
        self._prepare = self.service.prepare
        self.service.prepare = self  # type: ignore[method-assign]
        self.prompt: str | None = None

    def __call__(self, prompt: str, **kwargs: Any) -> PreparedPrompt:
        self.prompt = prompt
        return self._prepare(prompt, **kwargs)


class Loop:
    """One question's agent loop for one configuration: its model, tool and messages."""

    def __init__(self, name: str, engine: CacheBlendEngine, retriever: OverlapRetriever, args: argparse.Namespace):
        self.name = name
        options: dict[str, Any] = dict(engine=engine, max_tokens=args.max_new_tokens, temperature=0.0)
        if args.ratio is not None:
            options["recompute_ratio"] = args.ratio
        self.llm = ChatCacheBlend(reuse_chunk_kv=name != "full_prefill", **options)
        description = "Search the passages; returns the passages most related to the query."
        self.tool: BaseTool = (cacheblend_retriever_tool(retriever, self.llm, TOOL, description) if name == "blended"
                               else create_retriever_tool(retriever, TOOL, description))
        self.recorder = PromptRecorder(self.llm)
        self.last_messages: list[BaseMessage] = []  # the latest answering call's messages

    def reset_caches(self) -> None:
        """Empty the prefix and segment caches (shared by every model on the engine and store)."""
        service = self.llm.service
        for cache in (service.prefix_cache, service.segment_cache):
            if cache is not None:
                cache.clear()

    def first_call(self, question: str) -> tuple[list[BaseMessage], AIMessage, bool]:
        """The question and the model's first call: its own tool call, or one written for it."""
        messages: list[BaseMessage] = [SystemMessage(AGENT_SYSTEM), HumanMessage(question)]
        reply = self.llm.bind_tools([self.tool]).invoke(messages)
        by_model = bool(reply.tool_calls) and reply.tool_calls[0]["name"] == TOOL
        if not by_model:
            reply = AIMessage("", tool_calls=[{"name": TOOL, "args": {"query": question}, "id": "call_0",
                                               "type": "tool_call"}])
        return messages, reply, by_model

    def answering_messages(self, question: str, call: AIMessage) -> list[BaseMessage]:
        """The first call made again (it fills the prefix cache as an agent's does), the tool's result."""
        messages, _, _ = self.first_call(question)
        return [*messages, call, self.tool.invoke(call.tool_calls[0])]

    def timed_answer(self, messages: list[BaseMessage]) -> dict[str, Any]:
        """The answering call streamed with ``max_tokens=1``: the time to its first chunk (the caller's first
        token), and to the stream's end (``call_s``: the request's bookkeeping after its last token too)."""
        bound = self.llm.bind_tools([self.tool])
        started, first, chunks = time.perf_counter(), None, []
        for chunk in bound.stream(messages, max_tokens=1):
            if first is None and (chunk.content or chunk.tool_call_chunks):
                first = time.perf_counter() - started
            chunks.append(chunk)
        wall = time.perf_counter() - started
        stats = functools.reduce(operator.add, chunks).response_metadata["cacheblend"]
        return {"ttft_s": wall if first is None else first, "call_s": wall, "service_ttft_s": stats["ttft_s"],
                **{k: stats.get(k) for k in TOKEN_STATS}}


@torch.inference_mode()
def fidelity(loop: Loop, prompt: str, args: argparse.Namespace, eos: set[int], golds: list[str]) -> dict[str, Any]:
    """The harness's measures for the blended answering call (see the module), on ``prompt`` as it stands
    now (the prefix cache holding the first call, the passages in the store)."""
    llm, service, engine = loop.llm, loop.llm.service, loop.llm.get_engine()
    config = llm.blend_config

    def measure() -> dict[str, Any]:
        prepared = service.prepare(prompt, reuse=True, blend=config)
        ids = [t for segment in prepared.segments for t in segment.token_ids]
        reference = run_request(engine, FullPrefillRequest(engine, ids), max_new_tokens=args.max_new_tokens,
                                eos_ids=eos, teacher_limit=args.teacher_tokens)
        forced = reference.answer_tokens(args.teacher_tokens)
        out = {"reference_answer": reference.text, "reference_f1": gold_f1(reference.text, golds)}
        for name, ratio in (("blend", config.recompute_ratio), ("full_reuse", 0.0)):
            blended = engine.blend(prepared.segments, config=dataclasses.replace(config, recompute_ratio=ratio),
                                   store=service.chunk_cache)
            logits = teacher_forced_logits(engine, blended.logits, blended.cache, len(blended.input_ids), forced)
            out[f"{name}_kl"] = float(token_kl(reference.teacher_logits, logits).mean())
            out[f"{name}_top1"] = top1_agreement(reference.teacher_logits, logits)
        out["recovery"] = recovery(out["blend_kl"], out["full_reuse_kl"])
        return out

    out = service.scheduler.call(measure)
    # The blend's own greedy answer, through the integration (the call an agent makes).
    answer = llm.bind_tools([loop.tool]).invoke(loop.last_messages, max_tokens=args.max_new_tokens).content
    out.update(answer=answer, answer_matches_reference=answers_match(answer, out["reference_answer"]),
               f1=gold_f1(answer, golds))
    return out


def run_question(engine: CacheBlendEngine, example: MusiqueExample, args: argparse.Namespace, eos: set[int],
                 index: int, repeats: int) -> dict[str, Any]:
    documents = corpus(engine, example, args.passage_tokens)
    retriever = OverlapRetriever(documents=documents, k=args.k)
    loops = {name: Loop(name, engine, retriever, args) for name in CONFIGS}
    loops["blended"].llm.warm(documents, show_progress=False)  # the corpus, precomputed at ingestion
    loops["blended"].reset_caches()
    _, call, by_model = loops["blended"].first_call(example.question)
    row: dict[str, Any] = {"question": example.question, "answers": example.answers, "call_by_model": by_model,
                           "call": call.tool_calls[0]["args"], "runs": {name: [] for name in CONFIGS}}
    for repeat in range(repeats):
        shift = (repeat + index) % len(CONFIGS)
        for name in CONFIGS[shift:] + CONFIGS[:shift]:
            loop = loops[name]
            loop.reset_caches()
            loop.last_messages = loop.answering_messages(example.question, call)
            row["runs"][name].append(loop.timed_answer(loop.last_messages))
    blended = loops["blended"]
    blended.reset_caches()
    blended.last_messages = blended.answering_messages(example.question, call)
    blended.timed_answer(blended.last_messages)  # records the prompt the call renders
    prompt = blended.recorder.prompt
    blended.reset_caches()
    blended.answering_messages(example.question, call)  # the prefix cache as the timed calls found it
    assert prompt is not None
    row["fidelity"] = fidelity(blended, prompt, args, eos, example.answers)
    row["passage_tokens"] = sum(len(engine.tokenize(d.page_content)) for d in retriever.invoke(example.question))
    row["median_ttft_s"] = {name: statistics.median(r["ttft_s"] for r in runs) for name, runs in row["runs"].items()}
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median_of(name: str) -> float:
        return statistics.median(r["median_ttft_s"][name] for r in rows)

    def per_question(name: str) -> list[float]:
        return [r["median_ttft_s"][name] / r["median_ttft_s"]["blended"] for r in rows]

    def median_service(name: str) -> float:
        return statistics.median(statistics.median(run["service_ttft_s"] for run in r["runs"][name]) for r in rows)

    fidelities = [r["fidelity"] for r in rows]
    recoveries = [f["recovery"] for f in fidelities if f["recovery"] is not None]
    speedup = median_of("blending_off") / median_of("blended")
    return {
        "median_ttft_s": {name: median_of(name) for name in CONFIGS},
        "speedup_vs_blending_off": speedup,
        "speedup_vs_full_prefill": median_of("full_prefill") / median_of("blended"),
        # The service's own TTFT (submitted to first token), and the whole call (to the stream's end, after the
        # request's bookkeeping: its K/V kept in the prefix cache).
        "median_service_ttft_s": {name: median_service(name) for name in CONFIGS},
        "median_call_s": {name: statistics.median(statistics.median(run["call_s"] for run in r["runs"][name])
                                                  for r in rows) for name in CONFIGS},
        "service_speedup_vs_blending_off": median_service("blending_off") / median_service("blended"),
        "service_speedup_vs_full_prefill": median_service("full_prefill") / median_service("blended"),
        "per_question_speedup_vs_blending_off": per_question("blending_off"),
        "per_question_speedup_vs_full_prefill": per_question("full_prefill"),
        "target_vs_blending_off": TARGET,
        "target_met": speedup >= TARGET,
        "fidelity": {
            "kl_mean": statistics.mean(f["blend_kl"] for f in fidelities),
            "full_reuse_kl_mean": statistics.mean(f["full_reuse_kl"] for f in fidelities),
            "recovery_mean": statistics.mean(recoveries) if recoveries else None,
            "top1_mean": statistics.mean(f["blend_top1"] for f in fidelities),
            "answers_identical_to_full_prefill": statistics.mean(f["answer_matches_reference"] for f in fidelities),
            "f1_mean": statistics.mean(f["f1"] for f in fidelities),
            "reference_f1_mean": statistics.mean(f["reference_f1"] for f in fidelities),
        },
        "calls_by_model": sum(r["call_by_model"] for r in rows),
        "median_prompt_tokens": statistics.median(r["runs"]["blended"][0]["prompt_tokens"] for r in rows),
        "median_passage_tokens": statistics.median(r["passage_tokens"] for r in rows),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    started = time.time()
    examples = load_musique(args.data, args.questions + 1)  # the last one warms up
    if len(examples) < args.questions + 1:
        raise ConfigError(f"--data holds {len(examples)} questions; --questions {args.questions} and a warm-up "
                          f"need {args.questions + 1}")
    engine = shared_engine(args.model, device=args.device, dtype=args.dtype)
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ConfigError("the agent loop renders its conversation with the model's chat template; this model has none")
    eos = eos_token_ids(engine)
    run_question(engine, examples[-1], args, eos, 0, repeats=1)  # untimed: kernels and allocator warm up
    rows = [run_question(engine, ex, args, eos, i, args.repeats) for i, ex in enumerate(examples[:-1])]
    shipped = ChatCacheBlend(engine=engine)
    return {
        "benchmark": "bench_agentic_rag",
        "model": {"name": engine.model_name, "device": str(engine.device),
                  "dtype": str(engine.dtype).removeprefix("torch."), "dtype_reason": engine.dtype_reason,
                  "blend_setting": describe_config(shipped.blend_config), "config_source": shipped.config_source},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "configs": {
            "blended": "shipped default; retriever tool from cacheblend_retriever_tool: passages read from the "
                       "chunk store and blended, earlier turns from the prefix cache",
            "blending_off": "same model, dtype and settings; plain create_retriever_tool, nothing announced: earlier "
                            "turns from the prefix cache (exact blocks), every passage token computed",
            "full_prefill": "reuse_chunk_kv=False: the whole answering prompt computed, no cache of any kind",
        },
        "ttft": "wall time of the answering call from stream() with max_tokens=1 to its first chunk (rendering, the "
                "tool results' lookup, prefix cache, blend, first token); call_s to the stream's end (the "
                "request's bookkeeping after its last token too); service_ttft_s is the response's own ttft_s",
        "machine": machine_info(engine.device),
        "git": git_info(),
        "elapsed_s": time.time() - started,
        "summary": summarize(rows),
        "questions": rows,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=DEFAULT_DATA, help="MuSiQue-format JSON (read in place)")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="model name or path (default: embedded SmolLM2)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto", help="'auto' (default): bfloat16 where this CPU runs it fast")
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--k", type=int, default=10, help="passages the retriever tool returns (MuSiQue has 10)")
    parser.add_argument("--passage-tokens", type=int, default=300,
                        help="cut each passage to this many tokens (the harness's --max-passage-tokens); 0: whole")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=None, help="recompute ratio (default: the shipped one)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--teacher-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    for name in ("questions", "k", "repeats", "max_new_tokens", "teacher_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.teacher_tokens > args.max_new_tokens:
        parser.error("--teacher-tokens must be at most --max-new-tokens")
    args.passage_tokens = args.passage_tokens or None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    document = run(args)
    text = json.dumps(document, indent=2, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
