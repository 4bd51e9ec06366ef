"""``make gpu-check``: the engine's correctness in bfloat16 on a GPU, then its speed there, in one table.

Where CUDA is present (under five minutes on one GPU):

1. correctness: the half-precision invariant tests (``tests/engine/test_half_precision.py``:
   ratio 1.0 against full prefill, ratio 0 against concatenation, the store round trip,
   deterministic selection, the correctness gate) run on the GPU, then SmolLM2 in bfloat16 on the
   GPU passes its correctness gate and blends from a disk store exactly as from memory; so does
   the quality model, Qwen2.5-Coder-1.5B-Instruct (``qwen2.5-coder-1.5b``), when it is installed
   on this machine (``make quality-model``; this script never fetches it, and says so when it
   skips it);
2. speed: TTFT of full prefill, full reuse, plain CacheBlend at 0.15 (``kv_deviation``) and the
   default at 0.15 (``query_profiled``), chunk KV in GPU memory and in a disk store (pinned
   host memory, copied layer by layer on a side stream), on SmolLM2-135M, on a randomly
   initialised Llama of about 1.2B parameters built from a config (no download; its answers mean
   nothing, its timing is a real 1B model's) and on the quality model when installed.

Where CUDA is absent it says so and exits 0. ``--device cpu --smoke`` runs every step on tiny
models on the CPU, to check the script itself (a tiny Qwen2 stands in for the quality model); its
invariant step runs one of the file's tests, since the suite runs the whole file on the CPU already.
Prints the table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from cacheblend_rag import BlendConfig, CacheBlendEngine, CachedSegment, FreshSegment, StoredSegment
from cacheblend_rag.errors import ModelLoadError
from cacheblend_rag.models import catalog
from cacheblend_rag.models.loader import cache_root
from cacheblend_rag.store import ChunkCache

REPO = Path(__file__).resolve().parents[1]
QUALITY_MODEL = "qwen2.5-coder-1.5b"
METHODS = {
    "full reuse": BlendConfig(recompute_ratio=0.0),
    "CacheBlend@0.15": BlendConfig(recompute_ratio=0.15, selection="kv_deviation"),
    "default@0.15": BlendConfig(recompute_ratio=0.15),
}
# A Llama-3.2-1B-shaped model: 16 layers, hidden 2048, 32 heads over 8 KV heads of 64, MLP 8192.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=32768,
                rope_theta=500000.0, tie_word_embeddings=True)


@dataclass
class Prompt:
    head: list[int]
    chunks: list[list[int]]
    tail: list[int]

    @property
    def ids(self) -> list[int]:
        return self.head + [t for c in self.chunks for t in c] + self.tail


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = run()
        int(torch.argmax(out.logits))  # the first token is sampled (and the device synchronized)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_prompt(vocab: int, chunks: int, chunk_tokens: int, seed: int = 0) -> Prompt:
    generator = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(100, vocab - 1, (n,), generator=generator).tolist()

    return Prompt(draw(24), [draw(chunk_tokens) for _ in range(chunks)], draw(40))


# ------------------------------------------------------------------ correctness
def run_invariant_tests(device: torch.device, *, select: str | None = None) -> dict[str, Any]:
    """The half-precision invariant tests on ``device`` (``select``: a pytest ``-k`` expression)."""
    env = {**os.environ, "CACHEBLEND_TEST_DEVICE": str(device)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(["-k", select] if select else []),
                           str(REPO / "tests" / "engine" / "test_half_precision.py")],
                          env=env, cwd=REPO, capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    return {"passed": done.returncode == 0, "summary": summary, "seconds": round(time.perf_counter() - started, 1),
            **({"output": done.stdout[-3000:] + done.stderr[-2000:]} if done.returncode else {})}


def check_store_round_trip(engine: CacheBlendEngine, prompt: Prompt) -> dict[str, Any]:
    """Blends from a disk store equal blends from memory (the store keeps the model's 16 bits)."""
    chunks = engine.prefill_chunks(prompt.chunks)
    in_memory = [FreshSegment(prompt.head), *map(CachedSegment, chunks), FreshSegment(prompt.tail)]
    stored = [FreshSegment(prompt.head), *(StoredSegment(c) for c in prompt.chunks), FreshSegment(prompt.tail)]
    with tempfile.TemporaryDirectory() as folder, ChunkCache(engine, folder) as cache:
        cache.warm(prompt.chunks)
        results = {}
        for name, cfg in METHODS.items():
            a, b = engine.blend(in_memory, config=cfg), engine.blend(stored, config=cfg, store=cache)
            results[name] = bool(torch.equal(a.logits, b.logits)) and b.stats.cache_hits == len(chunks)
    return {"passed": all(results.values()), "equal_by_method": results}


def check_correctness(engine: CacheBlendEngine, chunk_tokens: int) -> dict[str, Any]:
    """The model's correctness gate (ratio 1.0 against full prefill) and a disk-store round trip."""
    passed, error = engine.run_gate(BlendConfig())
    trip = check_store_round_trip(engine, random_prompt(engine.model.config.vocab_size, 3, min(chunk_tokens, 200)))
    return {"model": engine.model_name, "passed": passed, "relative_error": error, "store_round_trip": trip}


def correctness_line(checked: dict[str, Any], dtype: str) -> str:
    return (f"2. {checked['model']} {dtype}: correctness gate passed={checked['passed']} (relative error "
            f"{checked['relative_error']:.2e}); disk store round trip equal to memory: "
            f"{checked['store_round_trip']['passed']}")


def installed_quality_model() -> tuple[Path | None, str]:
    """The quality model's fetched GGUF, or ``None`` and why not. Never fetches: that is
    ``make quality-model``'s job, and a GPU check must not download a gigabyte."""
    model = catalog.lookup(QUALITY_MODEL)
    if model is None:
        return None, f"{QUALITY_MODEL} is not in the model catalog"
    try:
        path = catalog.installed_gguf(model, cache_root())
    except ModelLoadError as exc:
        return None, str(exc)
    return path, f"{model.name} is installed ({path})"


def quality_engine(device: torch.device, dtype: torch.dtype, smoke: bool) -> tuple[CacheBlendEngine | None, str]:
    """The quality model in ``dtype`` on ``device`` when it is installed (a tiny Qwen2 in a smoke run), and a line saying so."""
    if smoke:
        from cacheblend_rag.testing import tiny_engine

        engine = tiny_engine("qwen2", dtype=dtype, device=device)
        engine.model_name = f"tiny Qwen2 (smoke, for {QUALITY_MODEL})"
        return engine, f"smoke run: a tiny Qwen2 stands in for the quality model {QUALITY_MODEL}"
    path, why = installed_quality_model()
    if path is None:
        return None, (f"the quality model is not installed here, so its correctness check and TTFT are skipped "
                      f"({why})")
    started = time.perf_counter()
    engine = CacheBlendEngine.from_pretrained(QUALITY_MODEL, device=device, dtype=dtype)
    return engine, f"{why}, loaded in {time.perf_counter() - started:.0f} s"


# ------------------------------------------------------------------ speed
def time_methods(engine: CacheBlendEngine, prompt: Prompt, repeats: int) -> dict[str, Any]:
    device = engine.device
    engine.blend([FreshSegment(prompt.head), *map(CachedSegment, engine.prefill_chunks(prompt.chunks[:1])),
                  FreshSegment(prompt.tail)])  # warm-up, runs the correctness gate
    chunks = engine.prefill_chunks(prompt.chunks)
    in_memory = [FreshSegment(prompt.head), *map(CachedSegment, chunks), FreshSegment(prompt.tail)]
    stored = [FreshSegment(prompt.head), *(StoredSegment(c) for c in prompt.chunks), FreshSegment(prompt.tail)]
    full = median_seconds(lambda: engine.full_prefill(prompt.ids), device, repeats)
    row: dict[str, Any] = {"tokens": len(prompt.ids), "full prefill": full}
    with tempfile.TemporaryDirectory() as folder, ChunkCache(engine, folder) as cache:
        cache.warm(prompt.chunks)
        for name, cfg in METHODS.items():
            row[name] = median_seconds(lambda: engine.blend(in_memory, config=cfg), device, repeats)
            row[f"{name} (disk)"] = median_seconds(lambda: engine.blend(stored, config=cfg, store=cache), device, repeats)
    return row


def random_llama(device: torch.device, dtype: torch.dtype, smoke: bool) -> CacheBlendEngine:
    from transformers import AutoModelForCausalLM, LlamaConfig

    fields = dict(LLAMA_1B)
    if smoke:
        fields.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds on a GPU, no host copy
        model = AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=dtype)
    return CacheBlendEngine(model.eval(), None, model_name=f"random Llama {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B")


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["full prefill", *METHODS, *(f"{m} (disk)" for m in METHODS)]
    lines = ["| model | dtype | prompt tokens | " + " | ".join(columns) + " |", "|---" * (len(columns) + 3) + "|"]
    for row in rows:
        cells = [f"{row['full prefill'] * 1000:.1f} ms"]
        cells += [f"{row[c] * 1000:.1f} ms ({row['full prefill'] / row[c]:.1f}x)" for c in columns[1:]]
        lines.append(f"| {row['model']} | {row['dtype']} | {row['tokens']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--smoke", action="store_true", help="tiny models and prompts (checks the script on a CPU)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"CUDA is not available here (torch {torch.__version__}, "
              f"{'a CPU build' if torch.version.cuda is None else 'no visible GPU'}): nothing to check. "
              "Run `make gpu-check` on a machine with a GPU.")
        path, why = installed_quality_model()
        print(f"There it also checks the quality model: {why}." if path is not None else
              f"There it would skip the quality model: {why}.")
        return 0
    dtype = getattr(torch, args.dtype)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "dtype": args.dtype, "date": time.strftime("%Y-%m-%d")}
    print(f"gpu-check on {report['device']}, {args.dtype}, torch {torch.__version__}", flush=True)

    smoke_selection = "ratio_one_equals_full_prefill" if args.smoke else None
    report["invariant_tests"] = run_invariant_tests(device, select=smoke_selection)
    print(f"1. half-precision invariants on {device}: {report['invariant_tests']['summary']}", flush=True)

    if args.smoke:
        from cacheblend_rag.testing import tiny_engine

        small = tiny_engine("llama", dtype=dtype, device=device)
        small.model_name = "tiny Llama (smoke)"
        chunks, chunk_tokens, repeats = 3, 20, 1
    else:
        small = CacheBlendEngine.from_pretrained(device=device, dtype=dtype)
        chunks, chunk_tokens, repeats = args.chunks, args.chunk_tokens, args.repeats
    checked = check_correctness(small, chunk_tokens)
    print(correctness_line(checked, args.dtype), flush=True)
    report["store_round_trip"] = checked.pop("store_round_trip")
    report["gate"] = checked
    passed = checked["passed"]
    quality, why = quality_engine(device, dtype, args.smoke)
    report["quality_model"] = {"name": QUALITY_MODEL, "checked": quality is not None, "note": why}
    print(f"2. {why}", flush=True)
    if quality is not None:
        report["quality_model"].update(check_correctness(quality, chunk_tokens))
        print(correctness_line(report["quality_model"], args.dtype), flush=True)

    rows = []
    big = random_llama(device, dtype, args.smoke)
    for engine in (small, big, *([quality] if quality is not None else [])):
        prompt = random_prompt(engine.model.config.vocab_size, chunks, chunk_tokens, seed=1)
        row = time_methods(engine, prompt, repeats)
        rows.append({"model": engine.model_name, "dtype": args.dtype, **row})
        print(f"3. timed {engine.model_name} ({row['tokens']:,} tokens)", flush=True)
    report["ttft"] = rows
    print()
    print(table(rows))
    print()
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    ok = report["invariant_tests"]["passed"] and passed and report["store_round_trip"]["passed"]
    if quality is not None:
        ok = ok and report["quality_model"]["passed"] and report["quality_model"]["store_round_trip"]["passed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
