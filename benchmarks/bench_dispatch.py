"""Operations a blend dispatches against full prefill's, and its host syncs, on real model shapes (prints JSON).

On a GPU a 1.5B model's full prefill of 3,000 tokens takes about 26 ms (docs/performance.md, GPU),
so a blend's speed there is set by how many operations it launches, each costing the host some
microseconds, more than by its arithmetic. This counts them on the CPU, where the count is the
same: the top-level ATen operations of one blend (torch's profiler), per method, for randomly
initialised models with the real layer count, heads and head size of SmolLM2-135M and
Qwen2.5-1.5B, at MuSiQue's 10 passages of 300 tokens. Widths are shrunk (hidden size 128, a
small vocabulary), which changes no count and makes a run take seconds.

    .venv/bin/python benchmarks/bench_dispatch.py --out docs/data/dispatch_counts.json

No timing, so the machine may be busy. A method's ratio to full prefill's count, times full
prefill's GPU time where launches dominate, is a rough floor for its GPU time.

Beside each count, ``host syncs``: the calls of one blend that would make the host wait for a GPU
(``item``, ``tolist``, boolean indexing, ``bincount``...; :mod:`bench_support.host_syncs`), with
where each is made. Issue 58's yardstick: full reuse and CacheBlend at most 1.25x full prefill's
operations, the default (with its profile pass) at most 1.6x, and at most 4 host syncs a blend.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (its model shapes and prompt)

from cacheblend_rag import BlendConfig, CachedSegment, FreshSegment  # noqa: E402
from cacheblend_rag.bench.report import print_report  # noqa: E402
from bench_support.host_syncs import count_host_syncs  # noqa: E402
from cacheblend_rag.engine import attention  # noqa: E402

NARROW = dict(hidden_size=128, intermediate_size=64, vocab_size=2048)
SHAPES = {
    "SmolLM2-135M": ("llama", {**gpu_check.SMOLLM2_SHAPE, **NARROW, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "head_dim": 64}),
    "Qwen2.5-1.5B": ("qwen2", {**gpu_check.QWEN_1P5B_SHAPE, **NARROW, "num_attention_heads": 12,
                                "num_key_value_heads": 2, "head_dim": 128}),
}
# The timed methods, and the setting shipped for Qwen2.5-Coder-1.5B (probes every 10 tokens move the stale
# entries: the most per-layer work of any shipped setting).
METHODS = {**gpu_check.METHODS, "shipped 1.5B@0.2": BlendConfig(
    recompute_ratio=0.2, stale_key_correction=1.0, stale_value_correction=1.0, shift_probe_stride=10)}
TARGETS = {"full reuse": 1.25, "CacheBlend@0.15": 1.25, "default@0.15": 1.6}
MAX_SYNCS = 4


def dispatched(run: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """Top-level ATen operations of one call of ``run`` (after a warm-up call), and the commonest."""
    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    top = [e.name for e in prof.events()
           if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    return len(top), dict(collections.Counter(top).most_common(8))


def count_shape(arch: str, fields: dict[str, Any], chunks: int, chunk_tokens: int) -> dict[str, Any]:
    engine = gpu_check.random_model(arch, fields, "narrow", torch.device("cpu"), torch.float32, False)
    prompt = gpu_check.random_prompt(fields["vocab_size"], chunks, chunk_tokens, seed=1)
    segments = [FreshSegment(prompt.head), *map(CachedSegment, engine.prefill_chunks(prompt.chunks)),
                FreshSegment(prompt.tail)]
    full, full_top = dispatched(lambda: engine.full_prefill(prompt.ids))
    row: dict[str, Any] = {"layers": fields["num_hidden_layers"], "tokens": len(prompt.ids),
                           "full prefill": full, "commonest": {"full prefill": full_top},
                           "host syncs": {"full prefill": count_host_syncs(lambda: engine.full_prefill(prompt.ids)).count},
                           "host sync sites": {}}
    for name, cfg in METHODS.items():
        row[name], row["commonest"][name] = dispatched(lambda: engine.blend(segments, config=cfg))
        syncs = count_host_syncs(lambda: engine.blend(segments, config=cfg))
        row["host syncs"][name], row["host sync sites"][name] = syncs.count, syncs.by_site()
    row["targets met"] = all(row[m] <= limit * full for m, limit in TARGETS.items()) and all(
        count <= MAX_SYNCS for m, count in row["host syncs"].items() if m != "full prefill")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--chunk-tokens", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    # Counted as on a GPU: the engine splits a blend's attention into fewer calls there.
    rule = attention.rows_per_group
    on_gpu = rule(torch.device("cuda"))
    torch.manual_seed(0)
    report: dict[str, Any] = {"what": "top-level ATen operations of one call, as on a GPU, and its host syncs",
                              "targets": {"ops_vs_full_prefill_at_most": TARGETS, "host_syncs_at_most": MAX_SYNCS},
                              "rows": {}}
    for name, (arch, fields) in SHAPES.items():
        attention.rows_per_group = lambda device: on_gpu
        try:
            row = count_shape(arch, fields, args.chunks, args.chunk_tokens)
        finally:
            attention.rows_per_group = rule
        report["rows"][name] = row
        ratios = ", ".join(f"{m} {row[m]:,} ({row[m] / row['full prefill']:.2f}x, {row['host syncs'][m]} syncs)"
                           for m in METHODS)
        print(f"{name} ({row['layers']} layers, {row['tokens']:,} tokens): full prefill {row['full prefill']:,}; "
              f"{ratios}", file=sys.stderr)
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
