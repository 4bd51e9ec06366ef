"""A multi-turn RAG conversation on MuSiQue (issue 31): TTFT per turn and fidelity for full prefill, prefix
caching alone, blending alone and both together, through ``CacheBlendLLM.chat`` (prints JSON, ``--plot``).

The conversation. A system prompt of about 400 tokens, then per turn one user message holding a new
MuSiQue question's ``--passages`` passages (each cut to ``--max-passage-tokens``) and the question, as
CacheBlend's MuSiQue prompt lays them out (:mod:`cacheblend_rag.bench.prompt`), and the answer. Earlier
turns stay in the history, passages included, so turn ``t``'s prompt is turn ``t-1``'s prompt, its
answer and one new message: what a prefix cache can reuse grows with the conversation, and what it
cannot (the new passages) is what blending reuses. Before each turn its passages are announced to the
LLM (what ``CacheBlendNodePostprocessor`` does); every passage's KV is precomputed before the first
turn, untimed, as an ingestion pipeline would have done.

Identical histories. Every method's history holds full prefill's greedy answer (decoded with the
model's own forward), not the method's own: the prompts of one turn are then the same token ids for
every method, so their TTFTs compare the same work and their KL is against one reference. A method
whose answer differs from full prefill's sees the previous answer as new text in the next turn (its
prefix cache holds its own answer), so the identical history can only cost the blending methods reuse,
never give them any; ``answer_matches_reference`` says how often that happened.

The methods (:data:`METHODS`), each its own ``CacheBlendLLM`` on one shared engine and chunk store:

* ``full_prefill``: no reuse of any kind;
* ``prefix_caching``: the exact prefix cache alone, as vLLM would reuse it (no chunk blending: nothing
  is announced to it, so its LLM warns once per conversation that no chunk text was announced);
* ``blending``: chunk blending alone, as before the prefix cache (issue 31's "today");
* ``prefix+blending``: both, with the segment cache on (``--segment-cache-bytes``, ``--segment-ratio``; the
  integrations turn it on by default, 64MB): the prefix cache keeps each turn's blended K/V (prompt
  and answer) as approximate blocks, so from turn 2 on the whole previous request is reused as is
  (``approximate_prefix_tokens``; ``exact_tokens`` is the system prompt) and only the new message is
  blended, its passages at ``approximate_prefix_chunk_factor`` times the ratio (0.45 at 0.15); spans after
  the chunks that no prefix reaches are blended like chunks (the 28-token instruction after the passages
  is too short a partial match to be served from the segment cache).

Per turn the methods take turns (their order rotates from turn to turn and from conversation to conversation,
so at turn 4 of conversations 1-3 each method is timed in three different places), one timed ``chat`` call each:
TTFT is the response's ``ttft_s`` (request start to the first token, as users see it). Before it, an
untimed pass blends the very same prompt the way the call will (``service.prepare`` and
``engine.blend`` on the scheduler's worker, which insert nothing into any cache) and teacher-forces
the reference's first ``--teacher-tokens`` answer tokens: KL(full prefill || method) per token, as
:mod:`cacheblend_rag.bench.harness` does. Speed numbers are compared as ratios within one run.

    .venv/bin/python benchmarks/bench_chat.py --data ../shared/data/musique_dev.json --conversations 3 \\
        --turns 6 --out results/bench_chat.json --plot results/bench_chat.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from llama_index.core.llms import ChatMessage
from llama_index.llms.cacheblend import CacheBlendLLM
from tqdm.auto import tqdm

from cacheblend_rag.bench.metrics import answers_match, gold_f1, token_kl, top1_agreement
from cacheblend_rag.bench.prompt import (PASSAGES_HEADER, QUESTION_INSTRUCTION, MusiqueExample, load_musique,
                                        passage_text)
from cacheblend_rag.bench.report import git_info, machine_info
from cacheblend_rag.bench.requests import FullPrefillRequest, run_request, teacher_forced_logits
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.reuse.prompt import default_conditioning_prefix
from cacheblend_rag.serving import shared_engine
from cacheblend_rag.store import ChunkCache, MemoryKVStore

DEFAULT_DATA = "../shared/data/musique_dev.json"
TARGET_TURN = 4
TARGETS = {"vs_blending": 1.5, "vs_full_prefill": 4.0}
# Per turn and method: exact K/V reused, prefix-cache K/V (exact and approximate), approximate of it, and the rest.
TURN_TOKENS = ("exact_tokens", "prefix_tokens", "approximate_prefix_tokens", "reused_tokens", "recomputed_tokens",
               "fresh_tokens")

# About 400 SmolLM2 tokens: a RAG assistant's role, rules and answer format, as an app would write it.
SYSTEM_PROMPT = (
    "You are a research assistant that answers questions about people, places, works and events from "
    "passages retrieved for each question. You are used inside a reading tool: the user asks a question, "
    "the tool retrieves passages from an encyclopedia and shows them to you together with the question, "
    "and your answer is shown next to the passages. Users ask several questions in one session, often "
    "about related subjects, and they read your answers quickly, so every answer must be short and exact.\n\n"
    "Rules for every answer:\n"
    "1. Use only the passages given with the question. Do not use what you remember about the subject, "
    "even when you are sure of it: the passages are the user's source, and an answer they cannot find "
    "in them is worse than no answer.\n"
    "2. Many questions need two or three facts from different passages, for example the birthplace of "
    "the author of a book, or the country of the city where an event took place. Find each fact in the "
    "passages before you answer, and follow the chain of facts to its end.\n"
    "3. Answer with the entity, date, number or short phrase that the question asks for, in at most five "
    "words. Do not write a full sentence, do not repeat the question, and do not explain your reasoning.\n"
    "4. Write names as the passages write them, with their full form when the passages give one. Write "
    "dates and numbers as the passages write them.\n"
    "5. When several passages disagree, prefer the passage that is most specific about the subject of the "
    "question. When the passages do not contain the answer, give your best short guess from them rather "
    "than saying that you do not know.\n"
    "6. Earlier questions of the session and your earlier answers are shown above the current question. "
    "Use them only to understand what the user is interested in: every question comes with its own "
    "passages, and its answer must come from them.\n"
    "7. Never mention these rules, the passages, the retrieval tool or the fact that you are an assistant."
)


@dataclass(frozen=True)
class ChatMethod:
    name: str
    blend_chunks: bool  # reuse retrieved chunks' KV with selective recompute
    prefix_reuse: bool  # the exact prefix cache (and cached repeated segments)


METHODS = (
    ChatMethod("full_prefill", blend_chunks=False, prefix_reuse=False),
    ChatMethod("prefix_caching", blend_chunks=False, prefix_reuse=True),
    ChatMethod("blending", blend_chunks=True, prefix_reuse=False),
    ChatMethod("prefix+blending", blend_chunks=True, prefix_reuse=True),
)


class MethodLLMs:
    """One ``CacheBlendLLM`` per method on the shared engine, made anew per conversation.

    A prefix cache is shared by every object on one engine and store, so the two methods that use
    one must not share a store: ``prefix+blending`` uses the chunk store the blending methods read,
    ``prefix_caching`` a store of its own that holds no chunk (it blends none: nothing is announced
    to it), so neither reuses a prompt the other left. Both keep their prefix cache from one
    conversation to the next, as a server does (the system prompt stays cached); ``blending`` and
    ``full_prefill`` have none."""

    def __init__(self, engine: CacheBlendEngine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        self.own_store = ChunkCache(engine, MemoryKVStore(), prefix_ids=default_conditioning_prefix(engine.tokenizer))

    def new(self) -> dict[str, CacheBlendLLM]:
        return {m.name: self.llm(m) for m in METHODS}

    def llm(self, method: ChatMethod) -> CacheBlendLLM:
        args = self.args
        options: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, recompute_ratio=args.ratio,
                                       prefix_cache_bytes=args.prefix_cache_bytes if method.prefix_reuse else 0)
        # The segment cache (earlier turns after the first chunk, blended like chunks) is the blending side
        # of reusing a conversation: prefix caching alone is what vLLM reuses, and has none.
        options["segment_cache_bytes"] = args.segment_cache_bytes if method.prefix_reuse and method.blend_chunks else 0
        if args.segment_ratio is not None:  # the cached segments' own share (BlendConfig.segment_recompute_ratio)
            options["segment_recompute_ratio"] = None if args.segment_ratio < 0 else args.segment_ratio
        if args.approximate_prefix_ratio is not None:  # BlendConfig.approximate_prefix_recompute_ratio
            options["approximate_prefix_recompute_ratio"] = (None if args.approximate_prefix_ratio < 0
                                                             else args.approximate_prefix_ratio)
        if args.approximate_prefix_chunk_factor is not None:  # BlendConfig.approximate_prefix_chunk_factor
            options["approximate_prefix_chunk_factor"] = args.approximate_prefix_chunk_factor
        if method.prefix_reuse and not method.blend_chunks:
            options["chunk_cache"] = self.own_store
        # Prefix caching alone still goes through the chunk-finding path (with nothing announced, it finds
        # no chunk): reuse_chunk_kv=False is plain full prefill, which keeps no prefix either.
        return CacheBlendLLM.from_engine(self.engine, reuse_chunk_kv=method.prefix_reuse or method.blend_chunks,
                                         **options)


def announces(method_name: str) -> bool:
    return next(m for m in METHODS if m.name == method_name).blend_chunks


# --------------------------------------------------------------------------- the conversation
def turn_passages(engine: CacheBlendEngine, example: MusiqueExample, passages: int,
                  max_tokens: int | None) -> list[str]:
    """The question's passages as chunk texts, each cut to ``max_tokens`` tokens (as bench.prompt cuts them)."""
    texts = []
    for title, text in example.passages[:passages]:
        if max_tokens is not None:
            text = engine.tokenizer.decode(engine.tokenize(text)[:max_tokens])
        if (title + text).strip():
            texts.append(passage_text(title, text))
    return texts


def user_message(texts: Sequence[str], question: str) -> str:
    return PASSAGES_HEADER + "".join(texts) + QUESTION_INSTRUCTION + question.strip()


def render(engine: CacheBlendEngine, messages: Sequence[ChatMessage]) -> str:
    """The prompt ``CacheBlendLLM.chat`` renders for ``messages`` (the model's chat template)."""
    turns = [{"role": m.role.value, "content": m.content} for m in messages]
    return engine.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def reference(engine: CacheBlendEngine, llm: CacheBlendLLM, prompt: str, args: argparse.Namespace,
              eos: set[int]) -> tuple[str, list[int], torch.Tensor]:
    """Full prefill's greedy answer (the history's), the tokens teacher-forced and their logits."""
    ids = engine.tokenize(prompt)
    run = llm.service.scheduler.call(lambda: run_request(
        engine, FullPrefillRequest(engine, ids), max_new_tokens=args.max_new_tokens, eos_ids=eos,
        teacher_limit=args.teacher_tokens))
    assert run.teacher_logits is not None
    return run.text, run.answer_tokens(args.teacher_tokens), run.teacher_logits


def method_logits(llm: CacheBlendLLM, prompt: str, tokens: Sequence[int]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The method's teacher-forced logits on ``prompt``: the call's own segments and blend, untimed."""
    engine, service = llm.engine, llm.service

    @torch.inference_mode()
    def run() -> tuple[torch.Tensor, dict[str, Any]]:
        prepared = service.prepare(prompt, reuse=llm.reuse_chunk_kv, blend=llm.blend_config)
        blended = engine.blend(prepared.segments, config=llm.blend_config, store=service.chunk_cache)
        logits = teacher_forced_logits(engine, blended.logits, blended.cache, len(blended.input_ids), tokens)
        return logits, blended.stats.to_dict()

    return service.scheduler.call(run)


def run_turn(engine: CacheBlendEngine, llms: dict[str, CacheBlendLLM], histories: dict[str, list[ChatMessage]],
             texts: list[str], example: MusiqueExample, turn: int, args: argparse.Namespace,
             eos: set[int], conversation: int = 0) -> dict[str, Any]:
    message = ChatMessage(role="user", content=user_message(texts, example.question))
    for history in histories.values():
        history.append(message)
    prompt = render(engine, next(iter(histories.values())))
    prompt_tokens = len(engine.tokenize(prompt))
    if prompt_tokens + args.max_new_tokens > engine.context_window:
        raise ConfigError(f"turn {turn}'s prompt has {prompt_tokens} tokens, past the model's context of "
                          f"{engine.context_window} with the answer; lower --turns, --passages or --max-passage-tokens")
    answer, forced, reference_logits = reference(engine, next(iter(llms.values())), prompt, args, eos)
    names = list(llms)
    # The methods' order rotates from turn to turn and from conversation to conversation, so no method holds
    # one place (first after the reference's full prefill, say) at every turn of the median.
    shift = (turn - 1 + conversation) % len(names)
    row: dict[str, Any] = {"turn": turn, "prompt_tokens": prompt_tokens, "question": example.question,
                           "reference_answer": answer, "methods": {}}
    for name in names[shift:] + names[:shift]:
        llm = llms[name]
        if announces(name):
            llm.announce_chunks(texts)
        logits, _ = method_logits(llm, prompt, forced)
        response = llm.chat(histories[name])
        stats = response.additional_kwargs
        row["methods"][name] = {
            "ttft_s": stats["ttft_s"],
            "kl": float(token_kl(reference_logits, logits).mean()),
            "top1": top1_agreement(reference_logits, logits),
            "answer_matches_reference": answers_match(response.message.content, answer),
            "f1": gold_f1(response.message.content, example.answers),
            **{k: stats.get(k) for k in ("mode", *TURN_TOKENS, "cache_hits", "fallback_reason")},
        }
    for history in histories.values():
        history.append(ChatMessage(role="assistant", content=answer))
    return row


def warm_up(engine: CacheBlendEngine, llms: dict[str, CacheBlendLLM], examples: list[MusiqueExample],
            args: argparse.Namespace) -> None:
    """One untimed two-turn conversation per method on a question no timed conversation uses: the
    correctness gate, kernels and allocator warm up outside the timed turns."""
    texts = turn_passages(engine, examples[-1], 2, args.max_passage_tokens)
    for name, llm in llms.items():
        if announces(name):
            llm.precompute(texts)
            llm.announce_chunks(texts)
        messages = [ChatMessage(role="system", content=SYSTEM_PROMPT),
                    ChatMessage(role="user", content=user_message(texts, examples[-1].question))]
        answer = llm.chat(messages, max_new_tokens=2).message.content
        messages += [ChatMessage(role="assistant", content=answer),
                     ChatMessage(role="user", content=user_message(texts, examples[-1].question))]
        llm.chat(messages, max_new_tokens=2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    git = git_info()
    started = time.time()
    need = args.conversations * args.turns
    examples = load_musique(args.data, need + 1)  # the last one warms up
    if len(examples) < need + 1:
        raise ConfigError(f"--data holds {len(examples)} questions; {args.conversations} conversations of "
                          f"{args.turns} turns and a warm-up need {need + 1}")
    engine = shared_engine(args.model, device=args.device)
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ConfigError("bench_chat renders the conversation with the model's chat template; this model has none")
    eos = eos_token_ids(engine)
    methods = MethodLLMs(engine, args)
    conversations = []
    bar = tqdm(total=need, desc="bench_chat", unit="turn", disable=not args.progress)
    for c in range(args.conversations):
        # Fresh integration objects per conversation: no prompt of another conversation is cached.
        llms = methods.new()
        if c == 0:
            warm_up(engine, llms, examples, args)
            llms = methods.new()
        chosen = examples[c * args.turns:(c + 1) * args.turns]
        texts = [turn_passages(engine, ex, args.passages, args.max_passage_tokens) for ex in chosen]
        llms["blending"].precompute([t for turn in texts for t in turn])  # the chunk store both blending methods read
        histories = {name: [ChatMessage(role="system", content=SYSTEM_PROMPT)] for name in llms}
        turns = []
        for t, (example, turn_texts) in enumerate(zip(chosen, texts), start=1):
            bar.set_postfix_str(f"conversation {c + 1} turn {t}")
            turns.append(run_turn(engine, llms, histories, turn_texts, example, t, args, eos, conversation=c))
            bar.update(1)
        conversations.append(turns)
    bar.close()
    per_turn = summarize(conversations)
    return {
        "benchmark": "bench_chat",
        "model": {"name": engine.model_name, "device": str(engine.device),
                  "dtype": str(engine.dtype).removeprefix("torch.")},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "progress")},
        "system_prompt_tokens": len(engine.tokenize(SYSTEM_PROMPT)),
        "history": "identical: every method's history holds full prefill's greedy answer",
        "machine": machine_info(engine.device),
        "git": git,
        "elapsed_s": time.time() - started,
        "turns": per_turn,
        "targets": targets(per_turn),
        "conversations": conversations,
    }


# --------------------------------------------------------------------------- summaries
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(conversations: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per turn, over the conversations: each method's median TTFT, mean KL and median token counts,
    and the TTFT ratios the targets read."""
    out = []
    for index in range(max(len(c) for c in conversations)):
        rows = [c[index] for c in conversations if len(c) > index]
        methods: dict[str, Any] = {}
        for name in rows[0]["methods"]:
            runs = [r["methods"][name] for r in rows]
            methods[name] = {
                "ttft_s": _median([r["ttft_s"] for r in runs]),
                "kl": statistics.fmean(r["kl"] for r in runs),
                "top1": statistics.fmean(r["top1"] for r in runs),
                "answer_matches_reference": statistics.fmean(float(r["answer_matches_reference"]) for r in runs),
                **{k: _median([r.get(k) or 0 for r in runs]) for k in TURN_TOKENS},
            }
        ttft = {name: m["ttft_s"] for name, m in methods.items()}

        def ratio(slow: str, fast: str) -> float | None:
            return ttft[slow] / ttft[fast] if ttft.get(slow) and ttft.get(fast) else None

        out.append({
            "turn": index + 1,
            "conversations": len(rows),
            "prompt_tokens": _median([r["prompt_tokens"] for r in rows]),
            "methods": methods,
            "speedup": {
                "prefix+blending_vs_blending": ratio("blending", "prefix+blending"),
                "prefix+blending_vs_full_prefill": ratio("full_prefill", "prefix+blending"),
                "prefix+blending_vs_prefix_caching": ratio("prefix_caching", "prefix+blending"),
                "prefix_caching_vs_full_prefill": ratio("full_prefill", "prefix_caching"),
                "blending_vs_full_prefill": ratio("full_prefill", "blending"),
            },
        })
    return out


def targets(per_turn: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 31's targets at turn 4: prefix+blending >= 1.5x blending's and >= 4x full prefill's TTFT speed,
    with KL no worse than blending's."""
    row = next((r for r in per_turn if r["turn"] == TARGET_TURN), None)
    if row is None:
        return {"turn": TARGET_TURN, "evaluated": False, "reason": f"the run has fewer than {TARGET_TURN} turns"}
    speed, methods = row["speedup"], row["methods"]
    vs_blend, vs_full = speed["prefix+blending_vs_blending"], speed["prefix+blending_vs_full_prefill"]
    both_kl, blend_kl = methods["prefix+blending"]["kl"], methods["blending"]["kl"]
    checks = {
        "vs_blending": {"target": TARGETS["vs_blending"], "measured": vs_blend,
                        "met": vs_blend is not None and vs_blend >= TARGETS["vs_blending"]},
        "vs_full_prefill": {"target": TARGETS["vs_full_prefill"], "measured": vs_full,
                            "met": vs_full is not None and vs_full >= TARGETS["vs_full_prefill"]},
        "kl_no_worse_than_blending": {"measured": both_kl, "blending": blend_kl, "met": both_kl <= blend_kl},
    }
    return {"turn": TARGET_TURN, "evaluated": True, **checks, "all_met": all(c["met"] for c in checks.values())}


def plot(document: dict[str, Any], path: str | Path) -> Path:
    """TTFT per turn (log scale) and KL per turn, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = document["turns"]
    xs = [r["turn"] for r in turns]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    for name in turns[0]["methods"]:
        left.plot(xs, [r["methods"][name]["ttft_s"] * 1000 for r in turns], marker="o", label=name)
        right.plot(xs, [r["methods"][name]["kl"] for r in turns], marker="o", label=name)
    left.set_yscale("log")
    left.set_ylabel("TTFT, ms (median over conversations)")
    right.set_ylabel("teacher-forced KL(full prefill || method), nats")
    for ax in (left, right):
        ax.set_xlabel("turn")
        ax.set_xticks(xs)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    cfg = document["config"]
    plural = "s" if cfg["conversations"] > 1 else ""
    fig.suptitle(f"{document['model']['name']}: {cfg['conversations']} conversation{plural}, {cfg['passages']} "
                 f"passages of <= {cfg['max_passage_tokens']} tokens per turn, system prompt "
                 f"{document['system_prompt_tokens']} tokens, recompute {cfg['ratio']:g}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA, help="MuSiQue-format JSON (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--device", default=None)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--passages", type=int, default=10)
    parser.add_argument("--max-passage-tokens", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--teacher-tokens", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=0.15, help="recompute ratio of the blending methods")
    parser.add_argument("--segment-ratio", type=float, default=None,
                        help="recompute ratio of cached segments (BlendConfig.segment_recompute_ratio; default the "
                        "package's; a negative value pools them with the chunks under --ratio)")
    parser.add_argument("--approximate-prefix-ratio", type=float, default=None,
                        help="recompute ratio of an approximate prefix's tokens (earlier turns from the prefix cache; "
                        "BlendConfig.approximate_prefix_recompute_ratio; default the package's; 0 reuses them as is, "
                        "a negative value pools them with the chunks under --ratio)")
    parser.add_argument("--approximate-prefix-chunk-factor", type=float, default=None,
                        help="behind an approximate prefix reused as is, the chunks' ratio is --ratio times this "
                        "(BlendConfig.approximate_prefix_chunk_factor; default the package's; 1 keeps --ratio)")
    # A 6-turn conversation reaches about 7,000 tokens, past the package's default bound (256MB, about
    # 5,700 SmolLM2 tokens in float32): the bench's bound holds a whole conversation and the system prompt.
    parser.add_argument("--prefix-cache-bytes", default="1GB", help="bound of each prefix method's prefix cache")
    parser.add_argument("--segment-cache-bytes", default="1GB",
                        help="bound of prefix+blending's segment cache (the package's default is 0, off)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--plot", help="write a PNG of TTFT and KL per turn")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    for name in ("conversations", "turns", "passages", "max_new_tokens", "teacher_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.teacher_tokens > args.max_new_tokens:
        parser.error("--teacher-tokens must be <= --max-new-tokens (full prefill's answer is the teacher)")
    return args


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
