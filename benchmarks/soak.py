"""A soak: mixed traffic from 16 clients for ``--minutes`` while Redis stalls, dies and is flushed, the disk
fills, a rogue writer damages entries, a warm job is killed mid-write and the arrival rate triples; then a
report per phase (JSON, a PNG timeline beside it) and an exit code that is non-zero when an invariant fails.

    .venv/bin/python benchmarks/soak.py --minutes 2 [--seed 0] [--out soak.json]
    .venv/bin/python benchmarks/soak.py --table soak.json   # the Markdown table of docs/operations.md

It starts everything it needs: a redis-server on a free loopback port, a disk tier (a tmpfs when run as
root; otherwise a temporary folder whose full-disk phase is simulated, and the report says so), the
tiered store of the two (disk in front of Redis), and SmolLM2 through LangChain and LlamaIndex on one
engine and scheduler. docs/operations.md ("Soak") says what each phase does and what the invariants mean.

Invariants (the exit code): no hangs; every control answer (ratio 1.0) equal to full prefill's; every error
a clear one (a CacheBlendError with a message); no healthy entry lost; the counter identity; RSS growth
under 5% from the warm-up's end to the end, each read with nothing running (a lull after the warm-up);
open files and threads flat; and, unless ``--no-timing``, p99 TTFT back within 20% of healthy within 5 s
of each fault clearing (contended machines fail this one first).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cacheblend_rag.models.dtype_choice import cpu_model_name
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME

import soak_report
from soak_env import DEFAULT_DATA, TMPFS_BYTES, disk_full, healthy_keys, load_corpus, start_env
from soak_faults import FaultRunner, WarmJob, schedule
from soak_traffic import Traffic, rag_prompt

CONTROL_CANDIDATES = 8  # the control stream's candidate prompts by default (--control-prompts)


def _control_prompts(env: Any, corpus: Any, candidates: int) -> tuple[dict[str, tuple[str, int]], int]:
    """The control stream's prompts and full prefill's answers to them: candidates over warmed passages whose
    answer at ratio 1.0, asked alone before traffic, equals full prefill's (and how many were left out)."""
    reference, left_out = {}, 0
    for q in range(min(candidates, len(corpus.questions))):
        prompt = rag_prompt(corpus.warm[q], corpus.questions[q])
        answer = env.llms["full_prefill"].complete(prompt).text
        if env.llms["control"].complete(prompt).text == answer:
            reference[prompt] = (answer, len(corpus.warm[q]))
        else:
            left_out += 1
    if not reference:
        raise SystemExit("no control prompt answers alike at ratio 1.0 and in full prefill, even alone: the engine "
                         "itself differs from full prefill at ratio 1.0; run the soak with another dtype")
    return reference, left_out


def _observe_blends(chunk_cache: Any) -> list[dict[str, Any]]:
    """Every blend's ask of the store (chunks asked, hits and misses as planned, the load failures its source
    found while reading), whether its request finished or was cancelled: what the store's counters
    must add up to."""
    ledger: list[dict[str, Any]] = []
    real = chunk_cache.open_source

    def observed(engine: Any, segments: Any, **kwargs: Any) -> Any:
        source, hits, misses = real(engine, segments, **kwargs)
        entry = {"asked": len(segments), "hits": hits, "misses": misses, "load_failures": 0}
        ledger.append(entry)
        closing = source.close

        def close() -> None:  # the blend closes its source when done: its load failures are final then
            closing()
            entry["load_failures"] = int(getattr(source, "load_failures", 0))

        # The ledger keeps numbers only: a source kept alive would keep the chunk KV it read.
        source.close = close
        return source, hits, misses

    chunk_cache.open_source = observed
    return ledger


def _identity(ledger: list[dict[str, Any]], before: dict[str, int], after: dict[str, int],
              records: list[dict[str, Any]]) -> dict[str, Any]:
    """Store level: every chunk a blend asked the store for is one hit, miss or load failure in the counters,
    nothing counted twice. Request level: each answered request's hits + misses + load failures is the number
    of its passages (where no prefix or segment cache took a share of them), and the answered requests' sums
    are within the blends' (the rest is the share of cancelled and dropped requests)."""
    load_failures = sum(b["load_failures"] for b in ledger)
    blends = {"asked": sum(b["asked"] for b in ledger), "hits": sum(b["hits"] for b in ledger) - load_failures,
              "misses": sum(b["misses"] for b in ledger), "load_failures": load_failures}
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in ("hits", "misses", "load_failures", "corrupt")}
    store_ok = (counted["hits"], counted["misses"], counted["load_failures"]) == \
        (blends["hits"], blends["misses"], blends["load_failures"]) and \
        counted["hits"] + counted["misses"] + counted["load_failures"] == blends["asked"]
    mismatches, answered = [], {"hits": 0, "misses": 0, "load_failures": 0}
    for r in records:
        if r["outcome"] != "answer" or not r["stats"]:
            continue
        s = r["stats"]
        got = {"hits": s.get("cache_hits", 0), "misses": s.get("cache_misses", 0),
               "load_failures": s.get("load_failures", 0)}
        for k in answered:
            answered[k] += got[k]
        whole = sum(got.values())
        shared = s.get("prefix_tokens", 0) or s.get("segment_tokens", 0) or s.get("mode") != "blend"
        if whole > r["passages"] or (not shared and whole != r["passages"]):
            mismatches.append({"client": r["client"], "submitted": r["submitted"], "passages": r["passages"], **got})
    within = all(answered[k] <= blends[k] for k in answered)
    holds = store_ok and within and not mismatches
    summary = (f"store counted {counted['hits']} hits + {counted['misses']} misses + {counted['load_failures']} load "
               f"failures = {sum(counted[k] for k in ('hits', 'misses', 'load_failures'))} of {blends['asked']} "
               f"chunks asked by {len(ledger)} blends; answered requests' own stats {answered}; "
               f"{len(mismatches)} requests whose stats do not add up to their passages")
    return {"holds": holds, "summary": summary, "store_counted": counted, "blends": blends,
            "answered_requests": answered, "request_mismatches": mismatches[:10], "blends_observed": len(ledger)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    warmup_end, phases = schedule(args.minutes, args.seed)
    env = start_env(args.max_new_tokens, args.model)
    warm_job = None
    try:
        engine = env.chunk_cache.engine
        corpus = load_corpus(args.data, engine.tokenizer, questions=args.questions, passages=args.passages,
                             passage_tokens=args.passage_tokens)
        for llm in env.llms.values():
            llm.announce_chunks(corpus.announced)
        env.llms["llamaindex"].precompute([p for group in corpus.warm for p in group])
        env.chunk_cache.flush()
        healthy_before = healthy_keys(env, env.disk)
        redis_before = len(healthy_keys(env, env.store.tiers[-1]))
        reference, disagree_alone = _control_prompts(env, corpus, args.control_prompts)
        dtype = str(engine.dtype).removeprefix("torch.")
        warm_job = WarmJob(env.disk_path / "kv", env.redis.url(), corpus.job, env.chunk_cache.prefix_ids, dtype,
                           args.model)
        warm_job.wait_ready()
        ledger = _observe_blends(env.chunk_cache)
        counters_before = env.store.counters()
        traffic = Traffic(env.llms, corpus, rate=args.rate, seed=args.seed, deadline_s=args.deadline,
                          reference=reference, started=time.monotonic())
        traffic.prime()
        traffic.records.clear()
        traffic.started = time.monotonic()
        scheduler = env.llms["llamaindex"].service.scheduler
        sampler = soak_report.Sampler(traffic.now, scheduler, env.store.counters, lambda: _cache_bytes(env))
        faults = FaultRunner(env, traffic, phases, seed=args.seed, warm_job=warm_job, disk_full=disk_full,
                             live_keys=lambda: sorted(healthy_before))
        sampler.start()
        traffic.start()
        faults.start()
        end = args.minutes * 60
        soak_report.wait_until(warmup_end, traffic.now)
        traffic.pause()  # a lull: RSS read with nothing running (Sampler.settled), then the faults' traffic
        settled_at_warmup = sampler.settled(timeout_s=args.deadline)
        mappings_at_warmup = sampler.rss_by_mapping()
        traffic.resume()
        soak_report.wait_until(end, traffic.now)
        records = [r.to_dict() for r in traffic.stop(grace_s=args.deadline)]
        faults.join(30)
        settled_at_end = sampler.settled(timeout_s=args.deadline)
        mappings_at_end = sampler.rss_by_mapping()
        sampler.sample()
        sampler.stop()
        env.chunk_cache.flush()
        counters_after = env.store.counters()
        for phase, following in zip(phases, [*phases[1:], None]):
            phase.ends = following.began if following is not None and following.began is not None else end
        healthy_after = healthy_keys(env, env.disk)
        lost = sorted(healthy_before - healthy_after - faults.damaged_on_disk)
        phase_dicts = [p.to_dict() for p in phases]
        rows, healthy_p99 = soak_report.phase_rows(records, phase_dicts, sampler.samples, warmup_end, end)
        totals = {k: sum(r[k] for r in rows) for k in ("requests", "answers", "cancelled_on_purpose", "errors",
                                                        "clear_errors", "hangs", "control_compared", "control_equal")}
        report: dict[str, Any] = {
            "benchmark": "soak",
            "settings": {"minutes": args.minutes, "seed": args.seed, "model": args.model, "rate_per_s": args.rate,
                         "deadline_s": args.deadline, "max_new_tokens": args.max_new_tokens,
                         "questions": args.questions, "passages": args.passages,
                         "passage_tokens": args.passage_tokens, "control_candidates": args.control_prompts,
                         "timing_invariants": not args.no_timing},
            "machine": {"cpu": cpu_model_name(), "torch_threads": _torch_threads(),
                        "model": engine.model_name, "dtype": dtype},
            "store": {"tiers": env.store.describe(),
                      "disk_full": "simulated (not root): the disk tier's writes fail with ENOSPC"
                      if env.disk_simulated else f"tmpfs of {TMPFS_BYTES >> 20} MiB filled by an unrelated file"},
            "schedule": phase_dicts, "warmup_end_s": warmup_end,
            "healthy_ttft_p99_s": healthy_p99,
            "warmup_ttft_p99_s": soak_report.warmup_p99(records, warmup_end),  # the warm-up alone (lighter)
            "phases": rows, "totals": totals,
            "errors_seen": sorted({r["error"] for r in records if r["outcome"] in ("error", "hang")})[:20],
            "healthy_entries": {
                "definition": "disk-tier entries whose manifest and every layer pass the chunk cache's checks after "
                              "the warm-up; lost = healthy then, not healthy at the end, and not damaged on purpose "
                              "by the rogue writer (Redis is emptied on purpose by the restart and FLUSHALL, so its "
                              "entries are reported, not counted)",
                "before": len(healthy_before), "after": len(healthy_after & healthy_before),
                "damaged_on_purpose": len(faults.damaged_on_disk), "lost": lost,
                "redis_before": redis_before, "redis_after": len(healthy_keys(env, env.store.tiers[-1]))},
            "control_prompts": {
                "used": len(reference), "left_out": disagree_alone,
                "why": "a candidate whose answer at ratio 1.0 differs from full prefill's when asked alone, before any "
                       "traffic or fault, is left out: in bfloat16 ratio 1.0 is full prefill in the arithmetic, not bit "
                       "for bit, and a greedy answer on the edge flips; the control stream looks for answers that "
                       "faults and load change"},
            "identity": _identity(ledger, counters_before, counters_after, records),
            "resources": soak_report.resource_verdict(sampler.samples, warmup_end, end,
                                                      (settled_at_warmup, settled_at_end)),
            "rss_growth_by_mapping_mb": _growth(mappings_at_warmup, mappings_at_end),
            "scheduler": scheduler.stats(), "fault_injection_errors": faults.errors,
            "samples": sampler.samples,
        }
        checks = soak_report.invariants(report, timing=not args.no_timing)
        report["invariants"] = {name: [ok, what] for name, (ok, what) in checks.items()}
        report["passed"] = all(ok for ok, _ in checks.values()) and not faults.errors
        report["_records"] = records
        return report
    finally:
        if warm_job is not None:
            warm_job.close()
        env.close()


def _growth(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """The mappings whose resident memory grew most from the warm-up's end to the end, in MB."""
    grown = {name: after.get(name, 0) - before.get(name, 0) for name in set(before) | set(after)}
    return {name: round(b / 2**20, 1) for name, b in sorted(grown.items(), key=lambda kv: -abs(kv[1]))[:8]}


def _cache_bytes(env: Any) -> dict[str, Any]:
    """What the bounded caches hold: growth of RSS within these is no leak."""
    service = env.llms["llamaindex"].service
    prefix, spans = service.prefix_cache, service.segment_cache
    resident = env.chunk_cache.resident
    return {"prefix_cache_bytes": prefix.stats().bytes if prefix is not None else 0,
            "segment_cache_bytes": spans.stats().bytes if spans is not None else 0,
            "resident_bytes": resident.stats()["bytes"] if resident is not None else 0}


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long traffic runs (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the fault order and times, the clients' choices")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="served to both frameworks (tiny-llama: a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("soak.json"), help="the report; the PNG goes beside it")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second over all 16 clients")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds after which a request is a hang")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--questions", type=int, default=12, help="questions of the warmed corpus")
    parser.add_argument("--passages", type=int, default=3, help="passages per question")
    parser.add_argument("--passage-tokens", type=int, default=80)
    parser.add_argument("--control-prompts", type=int, default=CONTROL_CANDIDATES,
                        help="candidate prompts of the control stream, each answered twice before traffic")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MuSiQue dev file (else the demo corpus)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--no-timing", action="store_true", help="leave the recovery-time invariant out")
    parser.add_argument("--table", type=Path, default=None, help="print the Markdown table of a report and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(soak_report.table(json.loads(args.table.read_text())))
        return 0
    report = run(args)
    records = report.pop("_records")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**report, "requests": records}, indent=1))
    soak_report.plot(report, records, args.out.with_suffix(".png"))
    print(soak_report.table(report))
    failed = [f"{name}: {what}" for name, (ok, what) in report["invariants"].items() if not ok]
    failed += [f"fault injection failed: {e}" for e in report["fault_injection_errors"]]
    for line in failed:
        print(f"INVARIANT FAILED: {line}", file=sys.stderr)
    print(f"{'PASSED' if not failed else 'FAILED'}: report in {args.out}, timeline in {args.out.with_suffix('.png')}",
          file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
