"""TTFT at scale, chunk KV from the disk store: full prefill, full reuse, plain CacheBlend and the
default at one ratio, against the work bound of the model's shapes (prints JSON).

The prompt is ``bench_engine.py``'s: ``--chunks`` chunks of exactly ``--chunk-tokens`` tokens cut
from MuSiQue passages (``--data``; the demo corpus when absent) between a ChatML head and a
question. ``--store disk`` (the default) writes the chunks' KV into a temporary
:class:`~cacheblend_rag.store.DiskKVStore` through a :class:`~cacheblend_rag.store.ChunkCache`,
as the serving code does, and every blend reads it back from there (warm page cache: the disk
path's decoding, checks and layer pipelining, not the drive); ``--store memory`` passes the
chunks as tensors. After one warm-up of each method (it also runs the one-time correctness
gate), the methods take turns within every repeat, so a change of load on the machine touches
them alike; each reports the median of ``--repeats`` and the median of every phase the engine
times (``result.stats.timings``: profile, early/check/late layers, load wait), so a gap to the
bound can be explained. The bound (:mod:`cacheblend_rag.calibration.bound`) is worked out from the
loaded model's config: CacheBlend as published at ``--ratio``, and each method's own.

``--methods`` picks among ``full_prefill``, ``full_reuse``, ``cacheblend`` (``cacheblend@RATIO``),
``cacheblend+keyshift`` (the same with ``stale_key_correction=1``), ``cacheblend+probeshift`` (probe tokens,
the harness's ``+probeshift``),
``query_profiled`` (the built-in default's selection at ``--ratio``, reported as ``default@RATIO``; a blend
named ``NAME@RATIO`` runs at its own ratio), any other blend in the harness's ``--methods`` spelling
(``query_profiled+probeshift10@0.2``)
and ``default``: whatever the engine uses for the loaded model when given no setting, the setting
``cacheblend-rag calibrate`` saved for it or the built-in one, reported with its name and source
(its chunks are computed alone here, as every method's: a calibration's prefix conditioning
changes the values, not the work).

    .venv/bin/python benchmarks/bench_engine_scale.py --model qwen2.5-coder-1.5b \\
        --chunks 10 --chunk-tokens 300 --store disk --repeats 3 --out results/engine_scale_qwen15.json \\
        --plot research/figures/engine_scale_qwen15.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench_engine import DEFAULT_DATA, build_prompt, git_commit, machine, passages
from bench_store import Mode, run_interleaved
from cacheblend_rag import BlendConfig, CacheBlendEngine, CachedSegment, FreshSegment, StoredSegment
from cacheblend_rag.bench.report import print_report
from bench_support.bandwidth import loader_and_disk
from cacheblend_rag.calibration.bound import LayerShapes, work_bound
from cacheblend_rag.bench.methods import parse_methods
from cacheblend_rag.calibration.lookup import describe_config
from cacheblend_rag.store import ChunkCache, DiskKVStore

DEFAULT_TARGET = 3.5  # issue 23: the default at 0.15, ~3,000 tokens, 1.5B model, from the disk store
METHODS = ("full_prefill", "full_reuse", "cacheblend", "cacheblend+keyshift", "cacheblend+probeshift", "query_profiled",
           "default")
DEFAULT_METHODS = "full_prefill,full_reuse,cacheblend,query_profiled"


def method_configs(ratio: float, methods: str = DEFAULT_METHODS,
                   engine: CacheBlendEngine | None = None) -> dict[str, BlendConfig | None]:
    """The methods by name (``None``: full prefill); a blend named ``NAME@RATIO`` runs at that ratio instead
    of ``ratio``. The short-prompt fallback is off: this bench times the blend itself, and a smoke run's
    prompt is short. ``default`` needs the ``engine``."""
    configs: dict[str, BlendConfig | None] = {}
    for item in (m.strip() for m in methods.split(",") if m.strip()):
        base, _, pinned = item.partition("@")
        r = float(pinned) if pinned else ratio
        every = {
            "full_prefill": ("full_prefill", None),
            "full_reuse": ("full_reuse", BlendConfig(recompute_ratio=0.0, min_blend_tokens=0)),
            "cacheblend": (f"cacheblend@{r:g}",
                           BlendConfig(recompute_ratio=r, selection="kv_deviation", min_blend_tokens=0)),
            "cacheblend+keyshift": (f"cacheblend+keyshift@{r:g}",
                                    BlendConfig(recompute_ratio=r, selection="kv_deviation", stale_key_correction=1.0,
                                                min_blend_tokens=0)),
            "cacheblend+probeshift": (f"cacheblend+probeshift@{r:g}",  # as the harness's --methods spells it
                                      parse_methods(f"cacheblend+probeshift@{r:g}", [r])[0].blend_config(
                                          BlendConfig(min_blend_tokens=0))),
            "query_profiled": (f"default@{r:g}", BlendConfig(recompute_ratio=r, min_blend_tokens=0)),
        }
        if engine is not None:
            every["default"] = ("default", engine.default_config().with_overrides(min_blend_tokens=0))
        if pinned and base in ("full_prefill", "full_reuse", "default"):
            raise SystemExit(f"--methods: {item!r}: {base} takes no @RATIO")
        name, cfg = every[base] if base in every else harness_blend(item, r)
        configs[name] = cfg
    if "full_prefill" not in configs:  # every speedup is relative to it
        configs = {"full_prefill": None, **configs}
    return configs


def harness_blend(item: str, ratio: float) -> tuple[str, BlendConfig]:
    """Any other blend as the harness's ``--methods`` spells it (``query_profiled+probeshift10@0.2``), named
    as the harness names it. ``+prefix`` is dropped from the name: conditioning changes the chunks' values, not
    the work, and every method's chunks are computed alone here."""
    try:
        [spec] = parse_methods(item, [ratio])
    except Exception as error:  # the parser's message names the method and the fix
        raise SystemExit(f"{error}; or one of this bench's own: {', '.join(METHODS)}") from None
    if spec.kind != "blend":
        raise SystemExit(f"--methods: {item!r} is no blend; the baselines are full_prefill and full_reuse")
    name = spec.setting.replace("+prefix", "")
    return name, spec.blend_config(BlendConfig(min_blend_tokens=0))


def own_bound(engine: CacheBlendEngine, shapes: LayerShapes, cfg: BlendConfig | None, n: int, fresh: int) -> float | None:
    """The bound of the blend ``cfg`` runs (its check layer, its profile pass); ``None`` where the
    bound's model does not apply (full prefill, full reuse, a check at layer 0 without a profile)."""
    if cfg is None or cfg.recompute_ratio == 0:
        return None
    strategy, check_layer = engine.plan(cfg)
    profile = strategy.needs.profile
    if check_layer == 0 and profile is None:
        return None
    tokens = profile.question_tokens if check_layer == 0 else None
    return work_bound(shapes, n, fresh, cfg.recompute_ratio, check_layer=check_layer, profile_tokens=tokens)["bound"]


def median_timings(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for run in runs for k in run})
    return {k: statistics.median(run.get(k, 0.0) for run in runs) for k in keys}


def summarize(modes: dict[str, Mode], configs: dict[str, BlendConfig | None], engine: CacheBlendEngine,
              shapes: LayerShapes, n: int, fresh: int, bound: float) -> dict[str, dict[str, Any]]:
    full = statistics.median(modes["full_prefill"].times)
    results = {}
    for name, mode in modes.items():
        ttft = statistics.median(mode.times)
        speedup = full / ttft
        mine = own_bound(engine, shapes, configs[name], n, fresh)
        timings = median_timings(mode.timings)
        results[name] = {
            "ttft_s": ttft, "runs_s": mode.times, "speedup": speedup, "speedup_over_bound": speedup / bound,
            "own_bound": mine, "speedup_over_own_bound": None if mine is None else speedup / mine,
            "engine_mode": sorted(mode.engine_modes), "cache_hits": mode.hits, "cache_misses": mode.misses,
            "timings_s": timings,
            # what the engine's own clock leaves out: segment checks, store lookups, the first token's argmax
            "outside_engine_timings_s": ttft - timings.get("total", ttft),
        }
    return results


PHASES = ["profile", "early_layers", "check_layer", "late_layers"]


def plot(report: dict[str, Any], path: Path) -> Path:
    """One bar per method: its median TTFT split into the engine's phases (the rest is what lies
    outside them), with the TTFT each bound would give marked on the blends' bars. The load wait
    is spent inside the layers that read the store, so it is written on the bar, not stacked."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    results = report["results"]
    names = list(results)
    full = results["full_prefill"]["ttft_s"]
    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    bottom = [0.0] * len(names)
    for phase in ["full forward", *PHASES, "outside the phases"]:
        heights = []
        for name in names:
            t = results[name]["timings_s"]
            inside = t.get("total", 0.0) if name == "full_prefill" else sum(t.get(k, 0.0) for k in PHASES)
            if phase == "full forward":
                heights.append(inside if name == "full_prefill" else 0.0)
            else:
                heights.append(results[name]["ttft_s"] - inside if phase not in PHASES else t.get(phase, 0.0))
        heights = [max(h, 0.0) for h in heights]
        ax.bar(names, heights, bottom=bottom, label=phase.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, name in enumerate(names):
        row = results[name]
        wait = row["timings_s"].get("load_wait", 0.0)
        ax.annotate(f"{row['ttft_s']:.2f} s, {row['speedup']:.2f}x\nload wait {wait:.2f} s", (i, row["ttft_s"]), ha="center",
                    textcoords="offset points", xytext=(0, 4), fontsize=8)
        if row["own_bound"]:
            ax.hlines(full / row["own_bound"], i - 0.4, i + 0.4, colors="black", linestyles="--")
    ax.plot([], [], "k--", label="TTFT at the method's work bound")
    ax.set_ylabel("median TTFT, s (phases: medians of the engine's timings)")
    ax.set_title(f"{report['model']}, {report['prompt_tokens']:,} tokens, chunk KV from {report['store']}, "
                 f"{report['machine']['device']} {report['machine']['dtype'].replace('torch.', '')}", fontsize=9)
    ax.set_ylim(top=1.15 * max(bottom))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def open_chunks(engine: CacheBlendEngine, chunk_ids: list[list[int]], store: str, folder: Path):
    """(cached segments, the ChunkCache they are read from or ``None``, seconds to precompute per chunk)."""
    start = time.perf_counter()
    if store == "memory":
        segments = list(map(CachedSegment, engine.prefill_chunks(chunk_ids)))
        return segments, None, (time.perf_counter() - start) / len(chunk_ids)
    cache = ChunkCache(engine, DiskKVStore(folder), resident_bytes=0)
    summary = cache.warm(chunk_ids)
    cache.flush()
    if summary.failed:
        raise SystemExit(f"{summary.failed} of {len(chunk_ids)} chunks could not be written to the disk store "
                         f"in {folder}; see the warnings above")
    return [StoredSegment(c) for c in chunk_ids], cache, (time.perf_counter() - start) / len(chunk_ids)


def read_every_layer(engine: CacheBlendEngine, cache: ChunkCache, stored: list[StoredSegment]) -> None:
    """Every layer of ``stored`` through the store's loader (as a blend of full reuse reads it), nothing computed."""
    source, _, _ = cache.open_source(engine, stored, first_layer=0)
    try:
        lengths = [len(s.token_ids) for s in stored]
        for layer in range(engine.num_layers):
            source.layer_parts(layer, lengths)
    finally:
        source.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="catalog name (qwen2.5-coder-1.5b), model folder, .gguf or hub id "
                                                 "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="e.g. float32 (the loader's default), bfloat16")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--chunk-tokens", type=int, default=300)
    p.add_argument("--store", choices=["disk", "memory"], default="disk", help="where the chunk KV is read from")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated, of {', '.join(METHODS)} (default: the engine's setting for the model, "
                        "calibrated or built in)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--plot", type=Path, default=None, help="also draw the TTFT bars, split into phases, as a PNG here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.chunks < 1 or args.chunk_tokens < 1 or args.repeats < 1:
        p.error("--chunks, --chunk-tokens and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None, engine: CacheBlendEngine | None = None) -> int:
    """``engine``: a ready engine (the tests pass a tiny one); otherwise ``--model`` is loaded."""
    args = parse_args(argv)
    if engine is None:
        engine = CacheBlendEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    head, chunk_ids, tail = build_prompt(engine, passages(args.data, args.chunks), args.chunks, args.chunk_tokens)
    ids = head + [t for c in chunk_ids for t in c] + tail
    n, fresh = len(ids), len(head) + len(tail)
    shapes = LayerShapes.of(engine.model.config)
    bound = work_bound(shapes, n, fresh, args.ratio)
    configs = method_configs(args.ratio, args.methods, engine)
    with tempfile.TemporaryDirectory(prefix="bench-engine-scale-") as folder:
        cached, cache, precompute_s = open_chunks(engine, chunk_ids, args.store, Path(folder))
        blended = [FreshSegment(head), *cached, FreshSegment(tail)]
        modes = {name: Mode(engine, blended, cache, full_prefill=cfg is None, config=cfg)
                 for name, cfg in configs.items()}
        try:
            run_interleaved(modes, args.repeats, show_progress=not args.no_progress)
            # The loader's cold read of every stored layer, beside the disk's own sequential read.
            bandwidth = None if cache is None else loader_and_disk(
                Path(folder), lambda: read_every_layer(engine, cache, cached))
        finally:
            if cache is not None:
                cache.close()
    results = summarize(modes, configs, engine, shapes, n, fresh, bound["bound"])
    if "default" in results:
        cfg, source = engine.default_and_source()
        results["default"].update(setting=describe_config(cfg), source=source)
    default = results.get(f"default@{args.ratio:g}", {}).get("speedup")
    report = {
        "benchmark": "engine_ttft_scale",
        "model": engine.model_name,
        "store": args.store,
        # "auto": 16 bits a value, the model's own in half precision, float16 from a float32 model
        "storage_dtype": "tensors as computed" if args.store == "memory" else "auto",
        "prompt_tokens": n, "fresh_tokens": fresh, "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
        "ratio": args.ratio, "repeats": args.repeats, "warm_up_runs_per_method": 1, "interleaved": True,
        "precompute_s_per_chunk": precompute_s,
        "load_bandwidth": bandwidth,
        "work_bound": bound,
        # timings_s: total is the engine's own clock; load_wait is spent inside the layer phases
        # that read the store, not beside them
        "results": results,
        "targets": {"default_speedup_at_least": DEFAULT_TARGET, "met": None if default is None else default >= DEFAULT_TARGET},
        "machine": machine(engine),
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print_report(report, args.out)
    if args.plot is not None:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
