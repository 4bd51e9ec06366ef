"""Where blending stops paying: TTFT of full prefill against blends on short prompts (prints JSON).

Prompts of ``chunks × chunk_tokens`` cached tokens (from 100 to 1,600 by default) behind the
chat template's system turn and before a question, as ``bench_engine.py`` builds them. For each
size: full prefill, the default blend at 0.15 (query-profiled: a profile pass, then the blend),
plain CacheBlend at 0.15 (kv_deviation: no profile pass) and full reuse (ratio 0), timed
interleaved (``--repeats`` rounds, each method once per round, medians reported). The engine's
``min_blend_tokens`` default comes from this table: below it, a blend runs full prefill instead
(switched off here so that every row measures a real blend).

    .venv/bin/python benchmarks/bench_short_prompts.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import DEFAULT_DATA, build_prompt, git_commit, passages  # noqa: E402

from cacheblend_rag import BlendConfig, CacheBlendEngine, CachedSegment, FreshSegment  # noqa: E402

SIZES = ((2, 50), (2, 100), (4, 100), (4, 200), (8, 200))


def _ttft(engine: CacheBlendEngine, segments, config: BlendConfig | None) -> float:
    start = time.perf_counter()
    result = engine.blend(segments, config=config)
    int(torch.argmax(result.logits))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default=None, help="model folder, .gguf or hub id (default: embedded SmolLM2)")
    args = parser.parse_args(argv)

    engine = CacheBlendEngine.from_pretrained(args.model)
    methods = {
        "default_0.15": BlendConfig(recompute_ratio=0.15, min_blend_tokens=0),
        "cacheblend_0.15": BlendConfig(recompute_ratio=0.15, selection="kv_deviation", min_blend_tokens=0),
        "full_reuse": BlendConfig(recompute_ratio=0.0, min_blend_tokens=0),
    }
    rows = []
    texts = passages(args.data, 8)
    for chunks, chunk_tokens in tqdm(SIZES, desc="prompt sizes"):
        head, chunk_ids, tail = build_prompt(engine, texts, chunks, chunk_tokens)
        cached = [FreshSegment(head), *map(CachedSegment, engine.prefill_chunks(chunk_ids)), FreshSegment(tail)]
        fresh = [FreshSegment(head + [t for c in chunk_ids for t in c] + tail)]
        for config in methods.values():  # warm-up (and the correctness gate, once)
            engine.blend(cached, config=config)
        runs: dict[str, list[float]] = {"full_prefill": [], **{name: [] for name in methods}}
        for _ in range(args.repeats):
            runs["full_prefill"].append(_ttft(engine, fresh, None))
            for name, config in methods.items():
                runs[name].append(_ttft(engine, cached, config))
        medians = {name: statistics.median(values) for name, values in runs.items()}
        rows.append({
            "prompt_tokens": len(fresh[0].token_ids),
            "cached_tokens": chunks * chunk_tokens,
            "chunks": chunks,
            "ttft_s": medians,
            "speedup_over_full_prefill": {name: medians["full_prefill"] / m for name, m in medians.items()},
        })
    print(json.dumps({
        "benchmark": "short_prompts",
        "model": engine.model_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "rows": rows,
        "git_commit": git_commit(),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
