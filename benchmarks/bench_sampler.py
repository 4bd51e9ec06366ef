"""Sampling's cost per token: microseconds and top-level ATen operations of ``TokenSampler.sample`` on
logits of SmolLM2's vocabulary, for the settings a user picks (prints JSON).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sampler.py --out sampler.json

Run it on two checkouts to compare samplers (the sampler moved to ``engine/sampling.py``; it is imported
from ``engine/generate.py``, where both versions have it). Each setting decodes ``--tokens`` tokens of
fixed random logits after a prompt of ``--prompt-tokens`` ids, ``--rounds`` times; the median round's
time per token is reported. On a CPU the numbers are the host's work (what a GPU would launch is the
operation count).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from cacheblend_rag import GenerationConfig
from cacheblend_rag.bench.report import print_report
from cacheblend_rag.engine.generate import TokenSampler
from cacheblend_rag.models.dtype_choice import cpu_model_name

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "greedy, min_new_tokens (bench_decode's)": {"temperature": 0.0, "min_new_tokens": -1},
    "greedy, repetition_penalty": {"temperature": 0.0, "repetition_penalty": 1.2},
    "temperature": {"temperature": 0.7, "seed": 1},
    "top_k, top_p": {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "seed": 1},
    "everything": {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2,
                   "seed": 1},
}


def _ops(run: Any) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))


def measure(options: dict[str, Any], vocab: int, prompt_tokens: int, tokens: int, rounds: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(vocab, generator=g) * 3 for _ in range(16)]
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
    if options.get("min_new_tokens") == -1:  # the whole answer: end of sequence held back at every token
        options = {**options, "min_new_tokens": tokens + 1}
    cfg = GenerationConfig(max_new_tokens=tokens + 1, **options).resolved(None)
    per_token = []
    for _ in range(rounds):
        sampler, generated = TokenSampler(cfg, prompt, eos=[0]), []
        generated.append(int(sampler.sample(logits[0], generated)))  # the first call builds what it keeps
        started = time.perf_counter()
        for step in range(tokens):
            generated.append(int(sampler.sample(logits[step % 16], generated)))
        per_token.append((time.perf_counter() - started) / tokens)
    # Operations of a token early in the answer (min_new_tokens still holding end of sequence back).
    sampler = TokenSampler(cfg, prompt, eos=[0])
    sampler.sample(logits[0], [])
    ops = _ops(lambda: sampler.sample(logits[1], generated[:1]))
    return {"us_per_token": round(statistics.median(per_token) * 1e6, 1), "ops_per_token": ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2-135M's vocabulary")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = {"cpu": cpu_model_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "sampler": TokenSampler.__module__, "vocab": args.vocab, "prompt_tokens": args.prompt_tokens,
              "settings": {name: measure(options, args.vocab, args.prompt_tokens, args.tokens, args.rounds)
                           for name, options in SETTINGS.items()}}
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
