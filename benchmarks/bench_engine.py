"""TTFT of full prefill against blends at ratios 0, 0.15 and 1.0 (default selection) and plain
CacheBlend at 0.15, on SmolLM2 (prints JSON).

A prompt of ``--chunks`` passages of about ``--chunk-tokens`` tokens each, plus a question,
wrapped in the model's chat template. Passages come from the MuSiQue dev file when it is
present (``--data``), otherwise from the package's demo corpus. Chunk KV is precomputed
once (in memory); each method is timed ``--repeats`` times to its first sampled token and
the median is reported.

    .venv/bin/python benchmarks/bench_engine.py --chunks 6 --chunk-tokens 500

``bench_engine_scale.py`` times the same prompt with chunk KV from the disk store, the methods
taking turns, against the work bound of the model's shapes (e.g. the 1.5B quality model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cacheblend_rag import BlendConfig, CacheBlendEngine, CachedSegment, FreshSegment

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"


def passages(data: Path, count: int) -> list[str]:
    if data.exists():
        examples = json.loads(data.read_text())
        texts = [f"{c['title']}\n\n{c['text']}\n\n" for ex in examples for c in ex["ctxs"]]
    else:
        from cacheblend_rag.data import load_demo_corpus

        texts = [f"{doc.title}\n\n{doc.text}\n\n" for doc in load_demo_corpus()]
    return texts[: count * 8]


def build_prompt(engine: CacheBlendEngine, texts: list[str], chunks: int, chunk_tokens: int):
    # Concatenate passages and cut them into chunks of exactly chunk_tokens tokens, so the
    # prompt size does not depend on passage lengths.
    stream = [t for text in texts for t in engine.tokenize(text)]
    if len(stream) < chunks * chunk_tokens:
        raise SystemExit(f"not enough text for {chunks} chunks of {chunk_tokens} tokens")
    chunk_ids = [stream[i * chunk_tokens : (i + 1) * chunk_tokens] for i in range(chunks)]
    head = engine.tokenize(
        "<|im_start|>system\nAnswer the question from the passages, within 5 words.<|im_end|>\n"
        "<|im_start|>user\nPassages:\n"
    )
    tail = engine.tokenize("\n\nQuestion: Which place is mentioned first? Answer within 5 words.<|im_end|>\n"
                           "<|im_start|>assistant\n")
    return head, chunk_ids, tail


def time_to_first_token(engine, segments, config, repeats: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = engine.blend(segments, config=config)
        int(torch.argmax(result.logits))  # the first token is sampled
        runs.append(time.perf_counter() - start)
    return statistics.median(runs), runs


def git_commit() -> str | None:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine(engine: CacheBlendEngine) -> dict[str, object]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="model folder, .gguf or hub id (default: embedded SmolLM2)")
    args = parser.parse_args(argv)

    engine = CacheBlendEngine.from_pretrained(args.model)
    head, chunk_ids, tail = build_prompt(engine, passages(args.data, args.chunks), args.chunks, args.chunk_tokens)
    start = time.perf_counter()
    chunks = engine.prefill_chunks(chunk_ids)
    precompute_s = time.perf_counter() - start
    blended = [FreshSegment(head), *map(CachedSegment, chunks), FreshSegment(tail)]
    fresh = [FreshSegment(head + [t for c in chunk_ids for t in c] + tail)]

    engine.blend(blended, config=BlendConfig(recompute_ratio=0.15))  # warm-up, runs the correctness gate
    engine.full_prefill(fresh[0].token_ids)
    results = {}
    full_s, full_runs = time_to_first_token(engine, fresh, None, args.repeats)
    results["full_prefill"] = {"ttft_s": full_s, "runs_s": full_runs, "speedup": 1.0}
    for ratio in (0.0, 0.15, 1.0):
        ttft, runs = time_to_first_token(engine, blended, BlendConfig(recompute_ratio=ratio), args.repeats)
        results[f"blend_{ratio}"] = {"ttft_s": ttft, "runs_s": runs, "speedup": full_s / ttft}
    # The published recipe beside the default selection, on the same chunks (computed alone).
    plain = BlendConfig(recompute_ratio=0.15, selection="kv_deviation")
    ttft, runs = time_to_first_token(engine, blended, plain, args.repeats)
    results["cacheblend_0.15"] = {"ttft_s": ttft, "runs_s": runs, "speedup": full_s / ttft}

    report = {
        "benchmark": "engine_ttft",
        "model": engine.model_name,
        "prompt_tokens": len(fresh[0].token_ids),
        "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens,
        "blend_selection": BlendConfig().selection,  # blend_* rows; cacheblend_0.15 is kv_deviation
        "precompute_s_per_chunk": precompute_s / args.chunks,
        "results": results,
        "targets": {
            "blend_0.15_speedup_at_least": 4.5,
            "blend_1.0_slowdown_at_most": 1.1,
            "met": results["blend_0.15"]["speedup"] >= 4.5 and results["blend_1.0"]["ttft_s"] <= 1.1 * full_s,
        },
        "machine": machine(engine),
        "git_commit": git_commit(),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
