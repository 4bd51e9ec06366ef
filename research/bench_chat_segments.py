"""Should the text after the chunks (an app's system prompt, earlier turns) be blended like a chunk?

A two-turn RAG chat laid out as LlamaIndex's ``CondensePlusContextChatEngine`` lays it out: one
system message holding a fixed lead, the retrieved passages and the app's own system prompt, then
the history, then the new message. Turn 1 is served through :class:`BlendService` (ratio 0.15),
which leaves the span after its passages (system prompt, question, answer) in the segment cache.
Turn 2 retrieves other passages; its span after them opens with turn 1's. For turn 2 we compare,
against full prefill of the same prompt (teacher-forced KL over full prefill's first
``--teacher-tokens`` answer tokens, in nats, mean per position):

* ``span_fresh``: the span computed fresh (what the service did before the segment cache);
* ``span_from_turn1``: the span's K/V from turn 1's request, blended like a chunk;
* ``span_alone``: the span's K/V computed once on its own behind the conditioning prefix, as a
  chunk is, blended like a chunk;
* ``span_from_turn1_equal_cost``: as ``span_from_turn1`` at the ratio that recomputes as many tokens
  as ``span_fresh`` computes (the whole span and 0.15 of the chunks), chosen among chunks and span;
* ``span_from_turn1_full_reuse``: as ``span_from_turn1`` at ratio 0 (nothing recomputed), the floor.

The exact prefix (template and lead, from the prefix cache) is the same in every variant.

    .venv/bin/python research/bench_chat_segments.py --conversations 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from cacheblend_rag import BlendConfig, CacheBlendEngine, CachedSegment, FreshSegment
from cacheblend_rag.bench.metrics import token_kl
from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.data import DemoQuestion, load_demo_corpus, load_demo_questions
from cacheblend_rag.reuse.prefix_cache import PrefixCache
from cacheblend_rag.kv.segments import PrefixSegment
from cacheblend_rag.reuse.prompt import chunk_text, default_conditioning_prefix
from cacheblend_rag.serving import AnnouncedChunks, BlendService
from cacheblend_rag.reuse.segment_cache import SegmentCache
from cacheblend_rag.store import ChunkCache

LEAD = ("The following is a friendly conversation between a user and an AI assistant. The assistant is talkative "
        "and provides lots of specific details from its context. If the assistant does not know the answer to a "
        "question, it truthfully says it does not know.\n\nHere are the relevant documents for the context:\n\n")
APP_PROMPT = ("\n\nInstruction: Based on the above documents, provide a detailed answer for the user question below. "
              "Answer \"don't know\" if not present in the document. You are the help desk of the Emmerlin Gulf "
              "tourist office. Be polite and concise, answer in one or two sentences, quote numbers and names exactly "
              "as the documents give them, never invent opening hours or prices, and suggest the tourist office "
              "website for anything the documents do not cover.")


def passages_for(question: DemoQuestion, corpus: dict[str, str], k: int = 3) -> list[str]:
    names = sorted(corpus)
    start = names.index(question.source)
    return [chunk_text(corpus[names[(start + i * 7) % len(names)]]) for i in range(k)]


def prompt_of(engine: CacheBlendEngine, passages: list[str], history: list[dict], question: str) -> str:
    system = LEAD + "\n\n".join(passages) + APP_PROMPT
    messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": question}]
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def forced_logits(engine: CacheBlendEngine, result, tokens: list[int]) -> torch.Tensor:
    n = len(result.input_ids)
    ids = torch.tensor([tokens[:-1]], device=engine.device)
    positions = torch.arange(n, n + len(tokens) - 1, device=engine.device).unsqueeze(0)
    with torch.inference_mode():
        out = engine.model(input_ids=ids, cache=result.cache, position_ids=positions, use_cache=True)
    return torch.cat([result.logits[None], out.logits[0]])


def variants(engine: CacheBlendEngine, service: BlendService, prompt: str, prefix_ids: list[int]) -> dict:
    """Segments of turn 2's prompt per variant, from one preparation with the segment cache on."""
    prepared = service.prepare(prompt)
    segments = prepared.segments
    span_at = next(i for i, s in enumerate(segments) if isinstance(s, CachedSegment) and s.chunk.approximate)
    span = segments[span_at]
    fresh = [*segments[:span_at], FreshSegment(span.token_ids), *segments[span_at + 1:]]
    alone = CachedSegment(engine.prefill_chunk(span.token_ids, prefix_ids=prefix_ids))
    chunk_tokens = sum(len(s.token_ids) for s in segments if not isinstance(s, (FreshSegment, PrefixSegment)))
    chunk_tokens -= len(span.token_ids)
    # The ratio that recomputes as many tokens as span_fresh computes (the span, and 0.15 of the chunks),
    # leaving the blend to choose where among chunks and span they go.
    equal_cost = (0.15 * chunk_tokens + len(span.token_ids)) / (chunk_tokens + len(span.token_ids))
    return {
        "span_fresh": (fresh, 0.15),
        "span_from_turn1": (segments, 0.15),
        "span_from_turn1_equal_cost": (segments, equal_cost),
        "span_alone": ([*segments[:span_at], alone, *segments[span_at + 1:]], 0.15),
        "span_from_turn1_full_reuse": (segments, 0.0),
        "_span_tokens": len(span.token_ids),
    }


def run(args: argparse.Namespace) -> dict:
    engine = CacheBlendEngine.from_pretrained(args.model)
    corpus = {d.doc_id: f"{d.title}\n\n{d.text}" for d in load_demo_corpus()}
    questions = load_demo_questions()
    prefix_ids = default_conditioning_prefix(engine.tokenizer)
    chunks = ChunkCache(engine, prefix_ids=prefix_ids)
    service = BlendService(engine, chunks, AnnouncedChunks(256), PrefixCache(1 << 30),
                           SegmentCache(1 << 30, fingerprint=engine.fingerprint))
    greedy = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    kls: dict[str, list[float]] = {}
    tokens: dict[str, list[dict]] = {}
    for c in range(args.conversations):
        q1, q2 = questions[c % len(questions)], questions[(c + 5) % len(questions)]
        first_passages = passages_for(q1, corpus)
        service.announce(first_passages)
        first = service.generate(prompt_of(engine, first_passages, [], q1.question), greedy,
                                 BlendConfig(recompute_ratio=0.15))
        history = [{"role": "user", "content": q1.question}, {"role": "assistant", "content": first.result.text}]
        second_passages = passages_for(q2, corpus)
        service.announce(second_passages)
        prompt = prompt_of(engine, second_passages, history, q2.question)
        cases = variants(engine, service, prompt, prefix_ids)
        span_tokens = cases.pop("_span_tokens")
        ids = [t for s in cases["span_fresh"][0] for t in s.token_ids]
        reference = engine.full_prefill(ids)
        answer = engine.generate([FreshSegment(ids)], max_new_tokens=args.teacher_tokens).token_ids
        if len(answer) < 2:
            continue
        ref_logits = forced_logits(engine, reference, answer)
        for name, (segments, ratio) in cases.items():
            result = engine.blend(segments, config=BlendConfig(recompute_ratio=ratio), store=chunks)
            kl = float(token_kl(ref_logits, forced_logits(engine, result, answer)).mean())
            kls.setdefault(name, []).append(kl)
            stats = result.stats
            tokens.setdefault(name, []).append({"total": stats.total_tokens, "exact": stats.exact_tokens,
                                                "cached": stats.cached_tokens, "recomputed": stats.recomputed_tokens,
                                                "fresh": stats.fresh_tokens, "span": span_tokens})
        print(json.dumps({"conversation": c, **{k: round(v[-1], 5) for k, v in kls.items()}}), file=sys.stderr)
    return {
        "model": engine.model_name, "conversations": len(next(iter(kls.values()), [])),
        "teacher_tokens": args.teacher_tokens,
        "kl_mean": {k: statistics.fmean(v) for k, v in kls.items()},
        "kl_median": {k: statistics.median(v) for k, v in kls.items()},
        "tokens_mean": {k: {f: statistics.fmean(t[f] for t in v) for f in v[0]} for k, v in tokens.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--teacher-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24, help="turn 1's answer length")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
