"""Blend TTFT with chunk KV served from the memory tier, from disk with and without layer pipelining.

    .venv/bin/python benchmarks/bench_store.py [--chunks 8] [--repeats 5] [--data ../shared/data/musique_dev.json]

Prints one JSON object. The prompt is a MuSiQue question with ``--chunks`` of its passages
(about 300-500 SmolLM2 tokens each) as stored chunks. TTFT is the time of ``engine.blend``
(store lookups, loading, recompute, first-token logits), the median of ``--repeats`` runs
after one warm-up; the modes take turns, so load changes on the machine touch all alike.
For reference it also times blending from ChunkKV tensors already in memory, and full prefill. Before every disk run the store's files are dropped from the OS page
cache (``posix_fadvise(DONTNEED)``), so disk means disk, not memory; ``--keep-page-cache``
measures the warm-page-cache case instead.

Target: blend from a warm disk store with pipelining within 10% of blend from the memory tier.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "musique_dev.json"


def add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """Model and prompt options shared with bench_redis.py, so both measure the same prompt."""
    p.add_argument("--model", default=None, help="model name or path (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MuSiQue JSON (question, ctxs[{title,text}])")
    p.add_argument("--question", type=int, default=0, help="index of the MuSiQue question to use")
    p.add_argument("--chunks", type=int, default=8, help="stored chunks in the prompt (6-10 in the issue)")
    p.add_argument("--max-chunk-tokens", type=int, default=500, help="truncate passages to this many tokens")
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio")
    p.add_argument("--repeats", type=int, default=5)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_arguments(p)
    p.add_argument("--store-dir", type=Path, default=None, help="where the disk stores go (default: a temp dir)")
    p.add_argument("--keep-page-cache", action="store_true", help="do not drop store files from the page cache")
    return p.parse_args(argv)


def load_prompt(engine, args) -> tuple[list[list[int]], list[int], list[int], str]:
    """(chunk token ids, head ids, question ids, data source)."""
    if args.data.exists():
        records = json.loads(args.data.read_text())
        record = records[args.question % len(records)]
        passages = [f"{c.get('title', '')}\n{c['text']}".strip() for c in record["ctxs"]]
        k = args.question + 1
        while len(passages) < args.chunks and k < args.question + len(records):  # borrow from later questions
            passages += [f"{c.get('title', '')}\n{c['text']}".strip() for c in records[k % len(records)]["ctxs"]]
            k += 1
        question, source = record["question"], str(args.data)
    else:
        passages = [f"Passage {i}: " + "The river flows past the old mill and the town square. " * 40
                    for i in range(args.chunks)]
        question, source = "Which river flows past the mill?", "synthetic"
    chunks = [engine.tokenize(p + "\n\n")[: args.max_chunk_tokens] for p in passages[: args.chunks]]
    head = engine.tokenize("Answer the question from the passages below.\n\n")
    tail = engine.tokenize(f"Question: {question}\nAnswer:")
    return chunks, head, tail, source


def drop_page_cache(path: Path) -> None:
    if not hasattr(os, "posix_fadvise"):
        return
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)  # freshly written pages are dirty, and DONTNEED keeps dirty pages
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Mode:
    """One way of serving the prompt: segments, the store they come from, and what to do before each run."""

    def __init__(self, engine, segments, store=None, before=None, full_prefill: bool = False, config=None) -> None:
        self.engine, self.segments, self.store, self.before = engine, segments, store, before
        self.full_prefill = full_prefill
        self.config = config  # None: the engine's own
        self.times: list[float] = []
        self.timings: list[dict[str, float]] = []  # each run's per-phase engine timings
        self.engine_modes: set[str] = set()  # "blend", "full_reuse" or "full_prefill" (a fallback shows here)
        self.hits = self.misses = 0

    def run(self, record: bool = True) -> None:
        if self.before:
            self.before()
        start = time.perf_counter()
        if self.full_prefill:
            result = self.engine.full_prefill([t for s in self.segments for t in s.token_ids])
        else:
            result = self.engine.blend(self.segments, store=self.store, config=self.config)
        int(result.logits.argmax())
        elapsed = time.perf_counter() - start
        if hasattr(self.store, "flush"):
            self.store.flush()  # background write-backs and counters, outside the timed region
        if record:
            self.times.append(elapsed)
            self.timings.append(dict(result.stats.timings))
            self.engine_modes.add(result.stats.mode)
            self.hits, self.misses = result.stats.cache_hits, result.stats.cache_misses

    def summary(self) -> dict:
        return {"ttft_ms": 1000 * statistics.median(self.times), "ttft_ms_all": [round(1000 * t, 2) for t in self.times],
                "load_wait_ms": 1000 * statistics.median(t.get("load_wait", 0.0) for t in self.timings),
                "hits": self.hits, "misses": self.misses}


def run_interleaved(modes: dict[str, Mode], repeats: int, *, show_progress: bool = False) -> dict[str, dict]:
    """One warm-up each (it also runs the one-time correctness gate), then the modes take turns,
    so that a change in machine load during the run touches every mode alike."""
    from tqdm.auto import tqdm

    with tqdm(total=len(modes) * (repeats + 1), desc="runs (warm-up first)", unit="run",
              disable=not show_progress) as bar:
        for mode in modes.values():
            mode.run(record=False)
            bar.update()
        for _ in range(repeats):
            for name, mode in modes.items():
                bar.set_postfix_str(name)
                mode.run()
                bar.update()
    return {name: mode.summary() for name, mode in modes.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from cacheblend_rag import BlendConfig, CacheBlendEngine, FreshSegment, StoredSegment
    from cacheblend_rag.store import ChunkCache, DiskKVStore, MemoryKVStore

    engine = CacheBlendEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                              config=BlendConfig(recompute_ratio=args.ratio))
    chunks, head, tail, source = load_prompt(engine, args)
    stored = [FreshSegment(head), *(StoredSegment(c) for c in chunks), FreshSegment(tail)]
    n_tokens = sum(len(s.token_ids) for s in stored)
    chunk_tokens = sum(len(c) for c in chunks)
    root = args.store_dir or Path(tempfile.mkdtemp(prefix="bench-store-"))
    torch.set_grad_enabled(False)

    report: dict = {
        "benchmark": "store", "model": engine.model_name, "device": str(engine.device), "dtype": str(engine.dtype),
        "data": source, "chunks": len(chunks), "chunk_tokens": [len(c) for c in chunks], "prompt_tokens": n_tokens,
        "recompute_ratio": args.ratio, "repeats": args.repeats, "page_cache": "kept" if args.keep_page_cache else "dropped",
    }

    memory = ChunkCache(engine, MemoryKVStore(), resident_bytes=0)
    memory.warm(chunks)
    disk_path = root / "disk16"
    disk = ChunkCache(engine, DiskKVStore(disk_path), resident_bytes=0)
    summary16 = disk.warm(chunks)
    unpiped = ChunkCache(engine, disk.store, prefetch=False)
    drop = None if args.keep_page_cache else (lambda: drop_page_cache(disk_path))
    modes = {
        # Reference points: chunk KV already in memory as tensors, and no cache at all.
        "chunkkv_tensors": Mode(engine, [FreshSegment(head), *engine.prefill_chunks(chunks), FreshSegment(tail)]),
        "full_prefill": Mode(engine, stored, full_prefill=True),
        "memory_tier": Mode(engine, stored, memory),
        "disk_pipelined": Mode(engine, stored, disk, drop),
        "disk_no_prefetch": Mode(engine, stored, unpiped, drop),
    }
    report["ttft"] = run_interleaved(modes, args.repeats)

    disk32 = ChunkCache(engine, DiskKVStore(root / "disk32"), storage_dtype="float32")
    summary32 = disk32.warm(chunks)
    report["bytes_per_token"] = {
        "16": summary16.bytes_written / chunk_tokens,
        "32": summary32.bytes_written / chunk_tokens,
        "16_on_disk_incl_index": disk.store.volume() / chunk_tokens,
        "32_on_disk_incl_index": disk32.store.volume() / chunk_tokens,
    }
    mem_ms = report["ttft"]["memory_tier"]["ttft_ms"]
    piped_ms = report["ttft"]["disk_pipelined"]["ttft_ms"]
    report["disk_pipelined_over_memory"] = piped_ms / mem_ms
    report["disk_no_prefetch_over_memory"] = report["ttft"]["disk_no_prefetch"]["ttft_ms"] / mem_ms
    report["target_within_10pct_met"] = piped_ms <= 1.10 * mem_ms
    for cache in (memory, disk, disk32):
        cache.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
