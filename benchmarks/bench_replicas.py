"""Two engine replicas behind `cacheblend-rag serve --ray`: the chunk router against Ray's default router
(power of two choices), on the same Zipf-skewed RAG traffic, closed loop (prints JSON; issue "Measured").

The corpus is ``--sets`` document sets, each the first 4-6 passages of one MuSiQue question, every passage cut to
``--passage-tokens`` tokens. Each request draws a set by Zipf(``--zipf``) over the sets (ranks in a seeded random
order), sends its passages as ``documents`` in a seeded shuffled order with a question drawn from all of the
file's questions, so that no whole-prompt prefix cache answers a repeat alone, streams (``include_usage``) and
reads the client TTFT at the first content chunk, and the usage chunk's ``cacheblend`` stats: ``replica`` and
``chunk_tiers`` (chunks from the replica's host-memory tier, the shared Redis store, or computed). The request
sequence is drawn once, so both routers see the identical one.

Each replica's memory tier (``--resident-bytes``) is sized from the model's K/V bytes per token (in the dtype
the server loads it in) to hold ``--tier-share`` of the corpus's chunks: one replica holds clearly less than the
corpus, two together most of it. For each router in turn the Redis store is flushed (both start cold), the
command started, every set warmed into the store through the app (``/v1/documents/warm``, routed like a request;
``--no-warm-store`` skips it), ``--warmup`` requests sent (not counted), then ``--requests`` from ``--clients`` client
threads, bounded by ``--max-minutes``, and the command stopped by SIGTERM to its pid. Beside the measurement,
``lru_model`` replays the same sequence one request at a time through LRU tiers of the same size: the chunk
policy's affinity alone (no queues, so no spill; no load bound) against a random replica, which is what this
workload allows a router at best.

    .venv/bin/python benchmarks/bench_replicas.py --out docs/data/bench_replicas.json --plot docs/bench_replicas.png
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(REPO / "tests" / "server"))
sys.path.insert(0, str(REPO / "tests" / "store_redis"))
from bench_engine import git_commit  # noqa: E402
from bench_http import messages_of, percentile  # noqa: E402
from redis_server import RedisServer  # noqa: E402  (a redis-server on a free loopback port, stopped by its pid)
from serve_process import ServeProcess  # noqa: E402  (serve as a subprocess, its URL line read, stopped by pid)

from cacheblend_rag.bench.prompt import load_musique  # noqa: E402
from cacheblend_rag.bench.report import print_report  # noqa: E402
from cacheblend_rag.models.dtype_choice import cpu_model_name  # noqa: E402
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME  # noqa: E402
from cacheblend_rag.serving.remote import sse_chunks  # noqa: E402
from cacheblend_rag.store.urls import redact  # noqa: E402

DEFAULT_DATA = Path(os.environ.get("CACHEBLEND_MUSIQUE", REPO.parent / "shared" / "data" / "musique_dev.json"))
ROUTERS = ("chunk", "default")
TIERS = ("memory", "store", "computed")
# The URL line comes once every replica has loaded its model: a local Ray and two SmolLM2 loads on 2 busy cores.
START_TIMEOUT_S = 600.0
QUICK = {"model": "tiny-llama", "sets": 8, "passage_tokens": 48, "warmup": 4, "requests": 16, "max_minutes": 3.0}
CORES_NOTE = ("Both replicas run on this one machine and share its cores (torch threads per replica: the cores "
              "divided between them), so absolute throughput does not grow with the second replica; what differs "
              "between the routers is where each request's chunks come from, and what that costs in TTFT.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL_NAME)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MuSiQue-format JSON ($CACHEBLEND_MUSIQUE)")
    p.add_argument("--sets", type=int, default=40, help="document sets, one per MuSiQue question (the first N)")
    p.add_argument("--min-passages", type=int, default=4, help="passages per set: drawn in [min, max], seeded")
    p.add_argument("--max-passages", type=int, default=6)
    p.add_argument("--passage-tokens", type=int, default=250, help="each passage cut to this many tokens")
    # s=0.7 and a quarter: at s=1.1 and 0.4 the hottest sets fill both tiers whatever the routing, and even a
    # perfect chunk router could hold only 1.21x the default's share in memory (the LRU model below, same
    # sequence); at 0.8 and 0.25 it is 1.64x, at 0.6 and 0.25 1.83x (2026-12-07, SmolLM2's tokenizer).
    p.add_argument("--zipf", type=float, default=0.7, help="Zipf exponent s over the sets")
    p.add_argument("--tier-share", type=float, default=0.25, help="corpus share one replica's memory tier holds")
    p.add_argument("--resident-bytes", type=int, default=None, help="the tier's bytes outright (not --tier-share)")
    p.add_argument("--clients", type=int, default=8, help="closed-loop client threads")
    p.add_argument("--no-warm-store", dest="warm_store", action="store_false",
                   help="skip putting every set in the store through the app before the timed requests")
    p.add_argument("--warmup", type=int, default=24, help="requests sent first and not counted")
    p.add_argument("--requests", type=int, default=300, help="measured requests per router")
    p.add_argument("--max-minutes", type=float, default=6.0,
                   help="bound on each router's traffic (warm-up too); 4 gave ~120 requests, and the default "
                        "router's memory share moved by 0.04 between runs")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--order", default="chunk,default",
                   help="the routers, in the order they run; one alone is a look at it, with no goals judged")
    p.add_argument("--replica-threads", type=int, default=None, help="torch threads per replica (serve's default)")
    p.add_argument("--redis-url", default=None, help="a Redis to use and flush, not one of the bench's own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} unless given")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:  # the quick values, where the flag was left at its default
        for name, value in QUICK.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.routers = [r.strip() for r in args.order.split(",") if r.strip()]
    if not args.routers or len(set(args.routers)) < len(args.routers) or not set(args.routers) <= set(ROUTERS):
        p.error(f"--order {args.order!r} must name {' or '.join(ROUTERS)} or both, each once")
    if min(args.sets, args.min_passages, args.passage_tokens, args.clients, args.requests, args.max_tokens) < 1 \
            or args.max_passages < args.min_passages or not 0 < args.tier_share <= 1 or args.warmup < 0:
        p.error("--sets, --min-passages, --passage-tokens, --clients, --requests, --max-tokens must be >= 1, "
                "--max-passages >= --min-passages, 0 < --tier-share <= 1, --warmup >= 0")
    return args


# ------------------------------------------------------------------------------------------- the traffic
def kv_layout(model: str) -> tuple[Any, int, str]:
    """The model's tokenizer, and its K/V bytes per token in the dtype the server loads it in (the same loader's
    choice on this machine): what one token of a chunk takes in a replica's memory tier."""
    import torch

    from cacheblend_rag.models.shapes import LayerShapes
    from cacheblend_rag.serving.engine_key import is_tiny_model_name, loader_model_argument

    if is_tiny_model_name(model):
        from cacheblend_rag.serving.registry import tiny_engine_named

        engine = tiny_engine_named(model)
        net, tokenizer = engine.model, engine.tokenizer
    else:  # loaded here, not through the process-wide registry: nothing else in this process holds it after
        from cacheblend_rag.models.loader import load_model

        loaded = load_model(loader_model_argument(model))
        net, tokenizer = loaded.model, loaded.tokenizer
    dtype = next(net.parameters()).dtype
    per_token = LayerShapes.of(net.config).kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    return tokenizer, per_token, str(dtype).removeprefix("torch.")


def document_sets(args: argparse.Namespace, tokenizer: Any) -> tuple[list[list[dict[str, str]]], list[str]]:
    """``--sets`` sets of passages (each ``{"title", "text"}``, cut), and every question of the file."""
    examples = load_musique(args.data)
    if len(examples) < args.sets:
        raise SystemExit(f"{args.data} has {len(examples)} questions, fewer than --sets {args.sets}")
    rng = random.Random(args.seed)

    def cut(text: str) -> str:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.passage_tokens]
        return tokenizer.decode(ids).strip()

    sets = [[{"title": title, "text": cut(text)}
             for title, text in ex.passages[: rng.randint(args.min_passages, args.max_passages)]]
            for ex in examples[: args.sets]]
    return sets, [ex.question for ex in examples]


def request_sequence(args: argparse.Namespace, sets: list[list[dict[str, str]]],
                     questions: list[str]) -> list[dict[str, Any]]:
    """Warm-up and measured requests, drawn once from the seed: the set (Zipf over ranks given in a seeded random
    order), its documents shuffled, a question; both routers get these very bodies in this order."""
    rng = random.Random(args.seed + 1)
    ranked = list(range(len(sets)))
    rng.shuffle(ranked)
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(len(sets))]
    out = []
    for index, rank in enumerate(rng.choices(range(len(sets)), weights, k=args.warmup + args.requests)):
        docs = list(sets[ranked[rank]])
        rng.shuffle(docs)
        body = {"messages": messages_of(rng.choice(questions)), "documents": docs, "max_tokens": args.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        out.append({"index": index, "set": ranked[rank], "body": body})
    return out


def stream_one(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: client TTFT, and the replica and chunk tiers its usage chunk reports."""
    started = time.perf_counter()
    ttft, usage, stats = None, None, None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return {"error": f"{response.status_code}: {response.text[:300]}"}
        header = response.headers.get("x-cacheblend-replica")
        for chunk in sse_chunks(response.iter_lines()):
            if "error" in chunk:
                return {"error": str(chunk["error"])[:300]}
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
            stats = chunk.get("cacheblend") or stats
    total = time.perf_counter() - started
    stats, usage = stats or {}, usage or {}
    return {"ttft_s": total if ttft is None else ttft, "replica": stats.get("replica") or header,
            "tiers": {t: int((stats.get("chunk_tiers") or {}).get(t, 0)) for t in TIERS}, "mode": stats.get("mode"),
            "server_ttft_s": stats.get("ttft_s"), "prefix_tokens": stats.get("prefix_tokens") or 0,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def closed_loop(url: str, items: list[dict[str, Any]], args: argparse.Namespace, deadline: float,
                bar: Any) -> tuple[list[dict[str, Any] | None], float]:
    """``items`` from ``--clients`` threads, each sending the next one as soon as its last is answered, until
    ``deadline`` (``None``: not sent); the results in the items' order and the wall time."""
    results: list[dict[str, Any] | None] = [None] * len(items)
    taken = iter(range(len(items)))
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client(timeout=args.request_timeout) as client:
            while time.monotonic() < deadline:
                with lock:
                    i = next(taken, None)
                if i is None:
                    return
                try:
                    row = stream_one(client, url, items[i]["body"])
                except Exception as error:  # noqa: BLE001 - an error of the run, counted, not raised
                    row = {"error": f"{type(error).__name__}: {error}"[:300]}
                results[i] = {"index": items[i]["index"], "set": items[i]["set"],
                              "documents": len(items[i]["body"]["documents"]), **row}
                bar.update(1)

    started = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        for future in [pool.submit(client_loop) for _ in range(args.clients)]:
            future.result()
    return results, time.perf_counter() - started


# ------------------------------------------------------------------------------------------- one router
def run_router(router: str, redis_url: str, resident_bytes: int, items: list[dict[str, Any]],
               args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    import psutil
    import redis
    from tqdm import tqdm

    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()  # both routers start cold: no chunk of the other's run in the store
    command = ["--ray", "--replicas", "2", "--router", router, "--store", redis_url, "--model", args.model,
               "--resident-bytes", str(resident_bytes), "--port", "0", "--graceful-shutdown", "10",
               *(["--replica-threads", str(args.replica_threads)] if args.replica_threads else [])]
    started = time.monotonic()
    serve = _Serve(command, logs / f"serve_{router}.log")
    try:
        serve.wait_healthy(timeout=START_TIMEOUT_S)
        start_s = time.monotonic() - started
        warm_row = warm_store(serve.url, items, args) if args.warm_store else None
        deadline = time.monotonic() + 60 * args.max_minutes
        with tqdm(total=len(items), desc=f"router={router}", file=sys.stderr, mininterval=2) as bar:
            warm, _ = closed_loop(serve.url, items[: args.warmup], args, deadline, bar)
            measured, wall = closed_loop(serve.url, items[args.warmup:], args, deadline, bar)
        descendants = [p.pid for p in psutil.Process(serve.process.pid).children(recursive=True)]
        stopped = time.monotonic()
        exit_code = serve.terminate(timeout=120)
        stop_s = time.monotonic() - stopped
        time.sleep(1)
        left = [pid for pid in descendants if psutil.pid_exists(pid)]
    finally:
        serve.stop()  # kills it only if still running (an error above); closes its log
    row = summarize([r for r in measured if r is not None], wall, warm)
    row.update(unsent=sum(r is None for r in measured), warmup_errors=sum(1 for r in warm if r and "error" in r),
               start_s=round(start_s, 1), stop_s=round(stop_s, 1), exit_code=exit_code, processes_left=len(left),
               warm_store=warm_row,
               serve_args=[redact(a) for a in command])
    return row


def warm_store(url: str, items: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Every set's documents put in the store through the app (``/v1/documents/warm``, routed as the router under
    test routes them), from ``--clients`` threads, before any request is timed: the run then measures where the
    chunks come from (a replica's memory or the shared store) and what that costs, not the corpus computed cold,
    which at ~1 request per 5 s on two 1-thread replicas would take the whole time bound."""
    sets = {item["set"]: item["body"]["documents"] for item in items}
    began = time.monotonic()
    with httpx.Client(timeout=args.request_timeout) as client, ThreadPoolExecutor(args.clients) as pool:
        answers = list(pool.map(lambda docs: client.post(url + "/v1/documents/warm", json={"documents": docs}),
                                sets.values()))
    bodies = [a.json() for a in answers if a.status_code == 200]
    return {"sets": len(sets), "failed_requests": len(answers) - len(bodies), "seconds": round(time.monotonic()
            - began, 1), "computed": sum(b.get("computed", 0) for b in bodies),
            "by_replica": dict(Counter(b.get("replica") for b in bodies))}


class _Serve(ServeProcess):
    """ServeProcess waiting longer for the URL line: --ray prints it only once both replicas have loaded."""

    def _first_line(self, timeout: float) -> tuple[str, str]:
        return super()._first_line(timeout=max(timeout, START_TIMEOUT_S))


def summarize(results: list[dict[str, Any]], wall: float, warm: list[dict[str, Any] | None]) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    tiers = {t: sum(r["tiers"][t] for r in ok) for t in TIERS}
    chunks = sum(tiers.values())
    ttfts = [r["ttft_s"] for r in ok]
    # Chunks a prefix cache covered are in no tier: documents_sent - sum(chunk_tiers) of them.
    out: dict[str, Any] = {"requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall, 2),
                           "requests_per_s": round(len(ok) / wall, 3) if wall else None, "chunk_tiers": tiers,
                           "documents_sent": sum(r["documents"] for r in ok),
                           **{f"{t}_share": round(tiers[t] / chunks, 4) if chunks else None for t in TIERS}}
    if ttfts:
        server = [r["server_ttft_s"] for r in ok if r.get("server_ttft_s") is not None]
        out.update(ttft_p50_ms=round(1000 * statistics.median(ttfts), 1),
                   ttft_p99_ms=round(1000 * percentile(ttfts, 0.99), 1),
                   server_ttft_p50_ms=round(1000 * statistics.median(server), 1) if server else None,
                   prefix_tokens_mean=round(statistics.fmean(r["prefix_tokens"] for r in ok), 1),
                   cached_tokens_mean=round(statistics.fmean(r["cached_tokens"] or 0 for r in ok), 1),
                   prompt_tokens_mean=round(statistics.fmean(r["prompt_tokens"] or 0 for r in ok), 1))
    out["per_replica_requests"] = dict(Counter(r["replica"] for r in ok))
    out["modes"] = dict(Counter(r["mode"] for r in ok))
    # A set's home: the replica that answered its first request (warm-up included, in the sequence's order).
    home: dict[int, tuple[int, str]] = {}
    for r in sorted([w for w in warm if w and "error" not in w] + ok, key=lambda r: r["index"]):
        home.setdefault(r["set"], (r["index"], r["replica"]))
    repeats = [r for r in ok if home[r["set"]][0] < r["index"]]
    out["repeats_on_first_replica_share"] = (round(sum(r["replica"] == home[r["set"]][1] for r in repeats)
                                                   / len(repeats), 4) if repeats else None)
    if len(ok) < len(results):
        out["first_error"] = next(r["error"] for r in results if "error" in r)
    return out


def lru_model(items: list[dict[str, Any]], chunk_bytes: dict[str, int], capacity: int, warmup: int,
              seed: int) -> dict[str, Any]:
    """The same sequence, one request at a time, through two LRU tiers of ``capacity`` bytes: the chunk policy's
    affinity alone (:meth:`ChunkRouting.rank` on the tiers' true contents: no queues so no spill, no load bound)
    against a random replica. Memory share of the measured part."""
    from cacheblend_rag.server.replicas.routing import ChunkRouting, ReplicaView, document_digest

    out: dict[str, Any] = {}
    for policy in ROUTERS:
        tiers: list[OrderedDict[str, int]] = [OrderedDict(), OrderedDict()]
        used, stored, counts = [0, 0], set(), Counter()
        routing, rng = ChunkRouting(), random.Random(seed)
        for item in items:
            digests = [document_digest(d["text"]) for d in item["body"]["documents"]]
            if policy == "chunk":
                views = [ReplicaView(str(j), None, frozenset(tiers[j])) for j in range(2)]
                r = int(routing.rank(views, digests)[0][0])
            else:
                r = rng.randrange(2)
            for digest in digests:
                tier = tiers[r]
                if digest in tier:
                    where = "memory"
                    tier.move_to_end(digest)
                else:
                    where = "store" if digest in stored else "computed"
                    stored.add(digest)
                    tier[digest] = chunk_bytes[digest]
                    used[r] += tier[digest]
                    while used[r] > capacity:
                        used[r] -= tier.popitem(last=False)[1]
                if item["index"] >= warmup:
                    counts[where] += 1
        out[f"{policy}_memory_share"] = round(counts["memory"] / max(1, sum(counts.values())), 4)
    out["ratio"] = round(out["chunk_memory_share"] / out["default_memory_share"], 3) \
        if out["default_memory_share"] else None
    return out


# ------------------------------------------------------------------------------------------- the run
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cacheblend_rag.server.replicas.launch import ReplicaOptions, replica_resources
    from cacheblend_rag.server.replicas.routing import document_digest

    tokenizer, per_token, dtype = kv_layout(args.model)
    sets, questions = document_sets(args, tokenizer)
    chunk_bytes = {document_digest(d["text"]): per_token * len(tokenizer(d["text"], add_special_tokens=False)
                                                               ["input_ids"]) for group in sets for d in group}
    corpus_bytes = sum(chunk_bytes.values())
    resident = args.resident_bytes if args.resident_bytes is not None else int(args.tier_share * corpus_bytes)
    items = request_sequence(args, sets, questions)
    skip = {"out", "plot", "data", "routers", "quick", "order", "redis_url"}
    report: dict[str, Any] = {
        "benchmark": "replicas", "cpu": cpu_model_name(), "cores": os.cpu_count(), "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"), "quick": args.quick, "order": args.routers,
        "torch_threads_per_replica": replica_resources(ReplicaOptions(replicas=2, threads=args.replica_threads),
                                                       local=True)[1],
        "note": CORES_NOTE,
        "config": {k: v for k, v in vars(args).items() if k not in skip},
        "sizing": {"dtype": dtype, "kv_bytes_per_token": per_token, "corpus_chunks": len(chunk_bytes),
                   "chunk_tokens_mean": round(corpus_bytes / per_token / max(1, len(chunk_bytes)), 1),
                   "corpus_chunk_bytes": corpus_bytes, "resident_bytes_per_replica": resident,
                   "one_tier_holds_share": round(resident / corpus_bytes, 3),
                   "two_tiers_hold_share": round(min(1.0, 2 * resident / corpus_bytes), 3),
                   "requests_per_set": dict(sorted(Counter(i["set"] for i in items).items()))},
        "redis": "one redis-server (" + ("given by --redis-url" if args.redis_url else "the bench's own, on a free "
                 "loopback port") + "), flushed before each router: both start cold, then each set is warmed through the app "
                 "unless --no-warm-store; the routers run one after "
                 "the other, each in its own Ray application, on the identical request sequence",
        "lru_model": lru_model(items, chunk_bytes, resident, args.warmup, args.seed),
    }
    logs = Path(tempfile.mkdtemp(prefix="bench_replicas_"))
    print(f"sizing: {report['sizing']}", file=sys.stderr, flush=True)
    own = None
    routers: dict[str, Any] = {}
    try:
        if args.redis_url:
            url = args.redis_url
        else:
            own = RedisServer(logs / "redis").start()
            url = own.url()
        for router in args.routers:
            routers[router] = run_router(router, url, resident, items, args, logs)
            print(f"router={router}: " + ", ".join(f"{k}={routers[router].get(k)}" for k in
                  ("requests", "errors", "memory_share", "ttft_p50_ms", "requests_per_s")), file=sys.stderr)
    except BaseException:
        print(f"bench_replicas: the serve and redis logs are kept in {logs}", file=sys.stderr)
        raise
    finally:
        if own is not None:
            own.stop()
    shutil.rmtree(logs, ignore_errors=True)  # kept above only when something failed
    report["routers"] = routers
    report["goals"] = goals(routers) if set(routers) == set(ROUTERS) else None  # a comparison, or nothing
    print_report(report, args.out)
    if args.plot:
        plot(report, args.plot)
    return 0


def goals(routers: dict[str, Any]) -> dict[str, Any]:
    chunk, default = routers["chunk"], routers["default"]
    share = (round(chunk["memory_share"] / default["memory_share"], 3)
             if chunk.get("memory_share") is not None and default.get("memory_share") else None)
    ttft = (round(chunk["ttft_p50_ms"] / default["ttft_p50_ms"], 3)
            if chunk.get("ttft_p50_ms") and default.get("ttft_p50_ms") else None)
    return {"memory_share_chunk_over_default": share, "ttft_p50_chunk_over_default": ttft,
            "memory_share_at_least_1_5x": share is not None and share >= 1.5,
            "ttft_p50_lower": ttft is not None and ttft < 1.0,
            "zero_errors": all(r["errors"] == 0 and r["warmup_errors"] == 0 for r in routers.values())}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["routers"])
    rows = [report["routers"][n] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    bottom = [0.0] * len(rows)
    for tier, color in zip(TIERS, ("tab:green", "tab:blue", "tab:gray")):
        values = [r.get(f"{tier}_share") or 0.0 for r in rows]
        left.bar(names, values, bottom=bottom, color=color, label=tier)
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set(ylabel="share of chunks", title="where each request's chunks came from")
    left.legend(fontsize=8)
    x = range(len(rows))
    right.bar([i - 0.2 for i in x], [r.get("ttft_p50_ms") or 0 for r in rows], 0.4, label="p50")
    right.bar([i + 0.2 for i in x], [r.get("ttft_p99_ms") or 0 for r in rows], 0.4, label="p99")
    right.set_xticks(list(x), names)
    right.set(ylabel="client TTFT (ms)", title=f"{report['config']['clients']} closed-loop clients")
    right.legend(fontsize=8)
    fig.suptitle(f"2 replicas of {report['config']['model']}, chunk router vs Ray's default\n{report['cpu']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
