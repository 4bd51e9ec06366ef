"""Operations a blend dispatches against full prefill's, on real model shapes (prints JSON).

On a GPU a 1.5B model's full prefill of 3,000 tokens takes about 26 ms (docs/performance.md, GPU),
so a blend's speed there is set by how many operations it launches, each costing the host some
microseconds, more than by its arithmetic. This counts them on the CPU, where the count is the
same: the top-level ATen operations of one blend (torch's profiler), per method, for randomly
initialised models with the real layer count, heads and head size of SmolLM2-135M and
Qwen2.5-1.5B, at MuSiQue's 10 passages of 300 tokens. Widths are shrunk (hidden size 128, a
small vocabulary), which changes no count and makes a run take seconds.

    .venv/bin/python benchmarks/bench_dispatch.py --out docs/dispatch_counts.json

No timing, so the machine may be busy. A method's ratio to full prefill's count, times full
prefill's GPU time where launches dominate, is a rough floor for its GPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (its model shapes and prompt)

from cacheblend_rag import CachedSegment, FreshSegment  # noqa: E402
from cacheblend_rag.engine import attention  # noqa: E402

NARROW = dict(hidden_size=128, intermediate_size=64, vocab_size=2048)
SHAPES = {
    "SmolLM2-135M": ("llama", {**gpu_check.SMOLLM2_SHAPE, **NARROW, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "head_dim": 64}),
    "Qwen2.5-1.5B": ("qwen2", {**gpu_check.QWEN_1P5B_SHAPE, **NARROW, "num_attention_heads": 12,
                                "num_key_value_heads": 2, "head_dim": 128}),
}
METHODS = gpu_check.METHODS


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
                           "full prefill": full, "commonest": {"full prefill": full_top}}
    for name, cfg in METHODS.items():
        row[name], row["commonest"][name] = dispatched(lambda: engine.blend(segments, config=cfg))
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
    report: dict[str, Any] = {"what": "top-level ATen operations of one call, as on a GPU", "rows": {}}
    for name, (arch, fields) in SHAPES.items():
        attention.rows_per_group = lambda device: on_gpu
        try:
            row = count_shape(arch, fields, args.chunks, args.chunk_tokens)
        finally:
            attention.rows_per_group = rule
        report["rows"][name] = row
        ratios = ", ".join(f"{m} {row[m]:,} ({row[m] / row['full prefill']:.2f}x)" for m in METHODS)
        print(f"{name} ({row['layers']} layers, {row['tokens']:,} tokens): full prefill {row['full prefill']:,}; "
              f"{ratios}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
