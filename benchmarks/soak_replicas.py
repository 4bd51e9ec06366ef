"""A soak through the Ray app: ``cacheblend-rag serve --ray --replicas 2`` on a Redis of its own for ``--minutes``
while Redis stalls, dies and is flushed, the arrival rate triples and one engine replica is killed; a report
(JSON, a PNG timeline) and an exit code that is non-zero when an invariant fails.

    .venv/bin/python benchmarks/soak_replicas.py --minutes 10 --out results/soak_replicas.json   # SmolLM2
    .venv/bin/python benchmarks/soak_replicas.py --minutes 1 --model tiny-llama                # a smoke run

Traffic: open loop, soak_traffic's 16 client threads and Poisson arrivals (``--rate`` requests/s over all of them,
x3 in the burst, no catching up when behind), over HTTP with ``documents``: 9 ask for whole answers, 2 read streams
to the end, 2 close theirs after the first text (cancelled on purpose), 3 ask over passages no one warmed (computed,
then written to Redis). The passages are soak_env's MuSiQue corpus (``../shared/data/musique_dev.json``), each
question's put in Redis through ``/v1/documents/warm`` before the clock (once the front end routes to both replicas).
Each replica's caches are bounded as soak_env bounds the in-process soak's (``--resident-bytes 16MB``,
``--prefix-cache-bytes 24MB``, ``--segment-cache-bytes 8MB``), so that they fill in the warm-up (RSS is then flat
unless something leaks) and Redis's faults reach requests. The in-process soak's multi-turn chats and control stream are
not sent: its chats carry their passages in the prompt's text, not as documents, and the control needs a full-prefill
twin of the engine, which the app does not have.

Faults: soak_faults' schedule for ``--minutes`` and ``--seed``, keeping what reaches this setup: Redis SIGSTOP 5 s,
Redis killed and restarted empty, FLUSHALL, the 3x burst. Its disk full, rogue writer and warm job killed act on the
in-process soak's disk tier, which the replicas do not have (Redis behind each replica's memory tier), so they are
left out; the earliest of their seeded slots takes ``replica_kill``: SIGKILL of one engine replica's process (a seeded
choice, once requests are in flight and it computes), then Ray's replacement awaited (two engine processes again; an
attempt that fails to start, as one does while Redis is stopped, is followed by another: the report lists them).

Invariants (the exit code): no hangs (``--deadline`` 120 s); no answer lost but the killed replica's: every failure
is a ``replica_failed`` on a request in flight at the kill or routed to the dead replica before Ray saw it gone
(``DETECT_GRACE_S``), or a clear error during a Redis fault; every error in OpenAI's shape with a message; each
replica's RSS growth under 5% (the in-process soak's bound) idle to idle, read in lulls (arrivals paused until nothing
runs, outside faults) at the warm-up's end, after the replacement's own warm-up (as long as the run's, and as many
answers as the fewest an original gave in it; not reached before the end, it is left out with a note) and at the end;
the killed replica replaced. Both replicas share the machine's cores (one torch thread each on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

import soak_report
from soak_env import DEFAULT_DATA, PREFIX_CACHE_BYTES, REPO, RESIDENT_BYTES, SEGMENT_CACHE_BYTES, load_corpus
from soak_faults import Phase, schedule
from soak_replicas_report import classify, invariants, plot, replacements, replica_ids, replica_rss, tiers
from soak_replicas_traffic import (HTTP_CLIENTS, REPLACE_TIMEOUT_S, SETTLE_S, EngineSampler, HttpTraffic,
                                   ReplicaFaults, lull)

sys.path.insert(0, str(REPO / "tests" / "server"))
from redis_server import RedisServer  # noqa: E402  (tests/store_redis, on sys.path through soak_env)
from serve_process import ServeProcess  # noqa: E402  (serve as a subprocess, its URL line read, stopped by pid)

from cacheblend_rag.models.dtype_choice import cpu_model_name  # noqa: E402
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME  # noqa: E402
from cacheblend_rag.store.urls import redact  # noqa: E402

KEPT = ("redis_sigstop", "redis_restart", "flushall", "burst")
LEFT_OUT = {name: "acts on the in-process soak's disk tier; the replicas' store is Redis behind a memory tier"
            for name in ("disk_full", "rogue_writer", "warm_job_killed")}
KILL_LABEL = "one engine replica killed (SIGKILL), Ray's replacement awaited"
START_TIMEOUT_S = 600.0  # the URL line comes once both replicas loaded: a local Ray and two models on 2 busy cores


def plan(minutes: float, seed: int) -> tuple[float, list[Phase]]:
    """soak_faults' schedule, kept faults only, and the replica kill in the earliest slot of those left out."""
    warmup_end, phases = schedule(minutes, seed)
    slot = next(p for p in phases if p.name not in KEPT)
    kill = Phase("replica_kill", KILL_LABEL, slot.planned_at, 0.0)
    return warmup_end, sorted([p for p in phases if p.name in KEPT] + [kill], key=lambda p: p.planned_at)


def tokenizer_for(model: str) -> Any:
    """The served model's tokenizer alone (no weights): soak_env's corpus cuts passages to its tokens."""
    from cacheblend_rag.serving.engine_key import is_tiny_model_name, loader_model_argument

    if is_tiny_model_name(model):
        from cacheblend_rag.testing import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    from cacheblend_rag.models import loader

    folder = loader._locate(loader_model_argument(model))[0]  # the embedded GGUF's converted folder, or a path
    return AutoTokenizer.from_pretrained(str(folder) if folder is not None else model)


def both_replicas_routed(url: str, timeout: float = 60.0) -> dict[str, Any]:
    """``GET /health`` (no documents: Ray's two random choices) until both replicas answered: the front end's router
    knows both. Right after the URL line its first requests may reach one only, and the router keeps a document
    set where it sent it first, so a corpus warmed then would all live on one replica."""
    seen: Counter[str] = Counter()
    began = time.monotonic()
    while len(seen) < 2 and time.monotonic() - began < timeout:
        seen[httpx.get(url + "/health", timeout=10).headers.get("x-cacheblend-replica") or "?"] += 1
        time.sleep(0.05)
    return {"probes": sum(seen.values()), "seconds": round(time.monotonic() - began, 2), "answered_by": dict(seen)}


class _Serve(ServeProcess):
    """ServeProcess waiting longer for the URL line: --ray prints it once both replicas have loaded."""

    def _first_line(self, timeout: float) -> tuple[str, str]:
        return super()._first_line(timeout=max(timeout, START_TIMEOUT_S))


def run(args: argparse.Namespace, root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    warmup_end, phases = plan(args.minutes, args.seed)
    corpus = load_corpus(args.data, tokenizer_for(args.model), questions=args.questions, passages=args.passages,
                         passage_tokens=args.passage_tokens)
    redis = RedisServer(root / "redis").start()
    # Every cache of a replica bounded as soak_env bounds the in-process soak's, so all are full in the warm-up.
    caches = {"resident_bytes": RESIDENT_BYTES, "prefix_cache_bytes": PREFIX_CACHE_BYTES,
              "segment_cache_bytes": SEGMENT_CACHE_BYTES}
    command = ["--ray", "--replicas", "2", "--store", redis.url(), "--model", args.model, "--port", "0",
               "--graceful-shutdown", "10",
               *(part for name, size in caches.items() for part in ("--" + name.replace("_", "-"), size))]
    serve = None
    try:
        began = time.monotonic()
        serve = _Serve(command, root / "serve.log")
        serve.wait_healthy(timeout=START_TIMEOUT_S)
        start_s = round(time.monotonic() - began, 1)
        front = both_replicas_routed(serve.url)
        placed = Counter()
        for group in corpus.warm:  # into Redis, each question's passages on the replica the router gives them
            warmed = httpx.post(serve.url + "/v1/documents/warm", json={"documents": group}, timeout=600)
            warmed.raise_for_status()
            placed[warmed.json().get("replica")] += 1
        traffic = HttpTraffic(serve.url, corpus, rate=args.rate, seed=args.seed, deadline_s=args.deadline,
                              max_tokens=args.max_new_tokens)
        traffic.prime()  # every client once, at once, before the clock: first calls belong to no phase
        traffic.restart_clock()
        sampler = EngineSampler(serve.process.pid, traffic.now)
        faults = ReplicaFaults(argparse.Namespace(redis=redis), traffic, phases, seed=args.seed, sampler=sampler)
        sampler.start()
        traffic.start()
        faults.start()
        end = args.minutes * 60
        soak_report.wait_until(warmup_end, traffic.now)
        lulls = {"warmup": lull(traffic, sampler, "warm-up end", args.deadline), "replacement": None}
        # The replacement's own warm-up: as long as the run's, and as many answers as the originals' fewest in it
        # (the router leaves it new document sets only, so fewer come its way): its caches full, as theirs were.
        warm_answers = min(lulls["warmup"]["answers_by_replica"].get(rid, 0) for rid in traffic.seen()[0])
        while traffic.now() < end:
            _, serving, answers = faults.replacement()
            faulting = any(p.began is not None and p.cleared is None for p in phases)  # no lull inside a fault
            if lulls["replacement"] is None and serving is not None and answers >= warm_answers and not faulting \
                    and serving + warmup_end <= traffic.now() < end - 2 * SETTLE_S:
                lulls["replacement"] = lull(traffic, sampler, "replacement's warm-up end", args.deadline)
            time.sleep(0.25)
        records = [{**r.to_dict(), **{k: r.stats.get(k) for k in ("replica", "chunk_tiers", "error_code",
                                                                      "store_error")}}
                   for r in traffic.stop(grace_s=args.deadline)]
        faults.join(REPLACE_TIMEOUT_S + 30)
        lulls["end"] = lull(traffic, sampler, "end", args.deadline)
        sampler.sample()
        sampler.stop()
        traffic.close()
        descendants = psutil.Process(serve.process.pid).children(recursive=True)
        stopping = time.monotonic()
        exit_code = serve.terminate(timeout=120)
        stop_s = round(time.monotonic() - stopping, 1)
        _, left = psutil.wait_procs(descendants, timeout=30)
    finally:
        if serve is not None:
            serve.stop()  # kills it only if still running (an error above); closes its log
        redis.stop()
    for phase, following in zip(phases, [*phases[1:], None]):
        phase.ends = following.began if following is not None and following.began is not None else end
    phase_dicts = [p.to_dict() for p in phases if p.began is not None]
    _, serving, answers = faults.replacement()
    kill = {**faults.kill, **replacements(sampler.samples, faults.kill, lulls["end"]), "replacement_serving_at_s":
            serving, "replacement_answers": answers, "replacement_warmup_answers_needed": warm_answers,
            **replica_ids(records, faults.kill, faults.ids_before)}
    rows, healthy_p99 = soak_report.phase_rows(records, phase_dicts, sampler.samples, warmup_end, end)
    for row in rows:  # what the replicas add to soak_report's rows
        inside = [r for r in records if row["start_s"] <= r["submitted"] < row["ends_s"]]
        answered = [r for r in inside if r["outcome"] == "answer"]
        row.update(replica_failed=sum(r["error_code"] == "replica_failed" for r in inside),
                   store_errors=sum(bool(r["store_error"]) for r in answered),  # answered, chunks computed instead
                   replicas=dict(Counter(r["replica"] for r in answered)), chunk_tiers=tiers(answered))
    answered = [r for r in records if r["outcome"] == "answer"]
    ttfts = [r["ttft"] for r in records if r["ttft"] is not None and r["outcome"] in ("answer", "cancelled")]
    totals = {k: sum(r[k] for r in rows) for k in ("requests", "answers", "cancelled_on_purpose", "errors",
                                                    "clear_errors", "hangs", "replica_failed", "store_errors")}
    totals.update(ttft_p50_s=soak_report.percentile(ttfts, 50), ttft_p99_s=soak_report.percentile(ttfts, 99))
    report: dict[str, Any] = {
        "benchmark": "soak_replicas",
        "settings": {"minutes": args.minutes, "seed": args.seed, "rate_per_s": args.rate, "deadline_s": args.deadline,
                     "max_new_tokens": args.max_new_tokens, "questions": args.questions, "passages": args.passages,
                     "passage_tokens": args.passage_tokens, "model": args.model, "replicas": 2,
                     "clients": len(HTTP_CLIENTS)},
        "machine": {"cpu": cpu_model_name(), "cores": os.cpu_count()},
        "traffic": "open loop: soak_traffic's 16 client threads, Poisson arrivals at rate_per_s over all (x3 in the "
                   "burst); " + ", ".join(f"{n} {m}/{k}" for (m, k), n in Counter(HTTP_CLIENTS).items()),
        "serve": {"args": [redact(a) for a in command], "start_s": start_s, "exit_code": exit_code, "stop_s": stop_s,
                  "processes_left": len(left), "front_end_saw_both_replicas": front,
                  "warmed_groups_by_replica": dict(placed),
                  **caches},
        "faults_left_out": LEFT_OUT, "schedule": phase_dicts, "warmup_end_s": warmup_end, "replica_kill": kill,
        "phases": rows, "totals": totals, "healthy_ttft_p99_s": healthy_p99,
        "replicas_seen": dict(Counter(r["replica"] for r in answered)), "chunk_tiers": tiers(answered),
        "failures": classify(records, kill, phase_dicts),
        "errors_seen": sorted({r["error"] for r in records if r["outcome"] in ("error", "hang")})[:20],
        "rss": {"bound": soak_report.RSS_GROWTH_LIMIT, "lulls": lulls, "replicas": replica_rss(lulls, sampler.samples,
                                                                                             kill),
                "phases_rss_max_mb": "every engine process's RSS together"},
        "fault_injection_errors": faults.errors, "samples": sampler.samples,
    }
    report["invariants"] = {name: [ok, what] for name, (ok, what) in invariants(report).items()}
    report["passed"] = all(ok for ok, _ in report["invariants"].values())
    return report, records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long traffic runs (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the fault order and times, the victim, the clients")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="served by both replicas (tiny-llama: a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("soak_replicas.json"), help="the report")
    parser.add_argument("--plot", type=Path, default=None, help="the PNG timeline (default: beside --out)")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second over all 16 clients")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds after which a request is a hang")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--questions", type=int, default=12, help="questions of the warmed corpus")
    parser.add_argument("--passages", type=int, default=3, help="passages per question")
    parser.add_argument("--passage-tokens", type=int, default=80)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MuSiQue dev file (else the demo corpus)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="soak-replicas-"))
    report, records = run(args, root)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**report, "requests": records}, indent=1))
    picture = args.plot or args.out.with_suffix(".png")
    plot(report, records, picture)
    print(soak_report.table(report))
    failed = [f"{name}: {what}" for name, (ok, what) in report["invariants"].items() if not ok]
    for line in failed:
        print(f"INVARIANT FAILED: {line}", file=sys.stderr)
    if failed:
        print(f"serve's log and Redis's kept in {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'PASSED' if not failed else 'FAILED'}: report in {args.out}, timeline in {picture}", file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
