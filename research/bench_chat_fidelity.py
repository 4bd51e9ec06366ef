"""Fidelity only, for one setting of prefix+blending on one bench_chat conversation: teacher-forced KL
against full prefill per turn, no timing (issue 31's research loop; deterministic, so a busy machine only
slows it).

The conversation is ``benchmarks/bench_chat.py``'s (its system prompt, 10 MuSiQue passages of 100 tokens and
a question per turn, full prefill's answer in the history), for one ``CacheBlendLLM`` with the prefix and
segment caches on and ``--options`` (JSON of its fields) on top of the package's defaults. Unlike the
bench there is no warm-up and no other method on the engine, so turn 1 finds no cached system prompt
(each run starts with empty prefix and segment caches).
``--refresh`` also runs each turn through a ratio-1.0 LLM on the same caches after the timed one, so
the next turn finds the history as exact blocks: what an exact history would give.

    .venv/bin/python research/bench_chat_fidelity.py --conversation 0 \\
        --options '{"approximate_prefix_chunk_factor": 1.0}' --out results/chat_fidelity.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from llama_index.core.llms import ChatMessage
from llama_index.llms.cacheblend import CacheBlendLLM

from cacheblend_rag.bench.metrics import token_kl, top1_agreement
from cacheblend_rag.bench.prompt import load_musique
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.reuse.prompt import default_conditioning_prefix
from cacheblend_rag.serving import shared_engine, slot_for
from cacheblend_rag.store import ChunkCache, MemoryKVStore

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))  # the conversation is the benchmark's own
import bench_chat as bc  # noqa: E402  (benchmarks/bench_chat.py)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    options = json.loads(args.options)
    if not isinstance(options, dict):
        raise ConfigError(f"--options must be a JSON object of CacheBlendLLM fields, got {args.options!r}")
    chat = bc.parse_args(["--turns", str(args.turns), "--conversations", "1", "--data", args.data,
                          "--model", args.model, "--passages", str(args.passages),
                          "--max-passage-tokens", str(args.max_passage_tokens),
                          "--max-new-tokens", str(args.max_new_tokens), "--teacher-tokens", str(args.teacher_tokens)])
    engine = shared_engine(args.model)
    examples = load_musique(args.data, (args.conversation + 1) * args.turns)
    chosen = examples[args.conversation * args.turns:(args.conversation + 1) * args.turns]
    if len(chosen) < args.turns:
        raise ConfigError(f"--data holds {len(examples)} questions; conversation {args.conversation} of "
                          f"{args.turns} turns needs {(args.conversation + 1) * args.turns}")
    spans = slot_for(engine).segment_cache  # one per engine: start empty, as a fresh process does
    if spans is not None:
        spans.clear()
    store = ChunkCache(engine, MemoryKVStore(), prefix_ids=default_conditioning_prefix(engine.tokenizer))
    fields = dict(max_new_tokens=chat.max_new_tokens, temperature=0.0, chunk_cache=store, prefix_cache_bytes="1GB",
                  segment_cache_bytes="1GB", **options)
    llm = CacheBlendLLM.from_engine(engine, reuse_chunk_kv=True, **fields)
    exact = CacheBlendLLM.from_engine(engine, reuse_chunk_kv=True, **{**fields, "recompute_ratio": 1.0})
    texts = [bc.turn_passages(engine, ex, chat.passages, chat.max_passage_tokens) for ex in chosen]
    llm.precompute([t for turn in texts for t in turn])
    eos = eos_token_ids(engine)
    history = [ChatMessage(role="system", content=bc.SYSTEM_PROMPT)]
    rows = []
    for turn, (example, turn_texts) in enumerate(zip(chosen, texts), start=1):
        history.append(ChatMessage(role="user", content=bc.user_message(turn_texts, example.question)))
        prompt = bc.render(engine, history)
        answer, forced, reference = bc.reference(engine, llm, prompt, chat, eos)
        llm.announce_chunks(turn_texts)
        logits, stats = bc.method_logits(llm, prompt, forced)
        llm.chat(history)
        if args.refresh:
            exact.announce_chunks(turn_texts)
            exact.chat(history)
        row = {"conversation": args.conversation, "turn": turn, "options": options, "refresh": args.refresh,
               "kl": float(token_kl(reference, logits).mean()), "top1": top1_agreement(reference, logits),
               **{k: stats.get(k) for k in bc.TURN_TOKENS}}
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        rows.append(row)
        history.append(ChatMessage(role="assistant", content=answer))
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=bc.DEFAULT_DATA)
    parser.add_argument("--model", default=bc.DEFAULT_MODEL_NAME)
    parser.add_argument("--conversation", type=int, default=0, help="which bench_chat conversation (0-based)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--passages", type=int, default=10)
    parser.add_argument("--max-passage-tokens", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--teacher-tokens", type=int, default=16)
    parser.add_argument("--options", default="{}", help="JSON of CacheBlendLLM fields, e.g. '{\"recompute_ratio\": 0.3}'")
    parser.add_argument("--refresh", action="store_true", help="make each turn's history exact for the next turn")
    parser.add_argument("--out", help="append each turn's row (JSON lines) here")
    args = parser.parse_args(argv)
    if args.conversation < 0 or args.turns < 1:
        parser.error("--conversation must be >= 0 and --turns >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
