"""Blend TTFT with chunk KV served from Redis on loopback (pipelined, and not) against the memory tier.

    .venv/bin/python benchmarks/bench_redis.py [--chunks 8] [--repeats 5] [--url redis://:PW@host:6379/0]

Prints one JSON object. Without ``--url`` a redis-server is started on 127.0.0.1 (a free
port, a password, no persistence) and stopped at the end; with ``--url`` the benchmark
uses that server under a prefix of its own and removes its keys afterwards.

The prompt is the one of ``bench_store.py``: a MuSiQue question with ``--chunks`` of its
passages as stored chunks (SmolLM2-135M-Instruct by default). TTFT is the median time of
``engine.blend`` over ``--repeats`` runs after one warm-up each; the modes take turns, run by
run, so that a busy machine slows them alike:

* ``memory_tier``: chunk KV read from a :class:`MemoryKVStore` (the same bytes, no I/O);
* ``redis_pipelined``: every blend reads every layer from Redis, one pipelined round trip
  per layer for all chunks, one layer ahead of the computation;
* ``redis_no_prefetch``: the same reads, each only when the layer is needed;
* ``full_prefill``: no cache at all, for scale.

``redis_layer_read_ms`` is the time of one pipelined read of one layer of all chunks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid

from bench_store import add_prompt_arguments, load_prompt  # the same prompt as the disk benchmark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="an existing Redis (default: start a local redis-server)")
    add_prompt_arguments(p)
    return p.parse_args(argv)


class LocalRedis:
    """A throwaway redis-server on loopback."""

    def __init__(self) -> None:
        import socket
        import subprocess

        import redis

        executable = shutil.which("redis-server")
        if executable is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server), or pass --url")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.password = uuid.uuid4().hex
        self.directory = tempfile.mkdtemp(prefix="bench-redis-")
        self.process = subprocess.Popen(
            [executable, "--bind", "127.0.0.1", "--port", str(self.port), "--requirepass", self.password,
             "--save", "", "--appendonly", "no", "--dir", self.directory, "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)
        self.version = client.info("server")["redis_version"]
        client.close()

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def time_modes(engine, modes: dict, repeats: int) -> dict[str, dict]:
    """Median blend time of each ``name: (segments, store)``, the modes interleaved run by run."""
    times: dict[str, list[float]] = {name: [] for name in modes}
    waits: dict[str, list[float]] = {name: [] for name in modes}
    stats: dict[str, object] = {}
    for run in range(repeats + 1):  # run 0 warms up (and runs the one-time correctness gate)
        for name, (segments, store) in modes.items():
            start = time.perf_counter()
            result = engine.blend(segments, store=store)
            int(result.logits.argmax())
            elapsed = time.perf_counter() - start
            if hasattr(store, "flush"):
                store.flush()  # counters and write-backs stay out of the next run's time
            if run:
                times[name].append(elapsed)
                waits[name].append(result.stats.timings.get("load_wait", 0.0))
            stats[name] = result.stats
    return {name: {"ttft_ms": 1000 * statistics.median(times[name]),
                   "ttft_ms_all": [round(1000 * t, 2) for t in times[name]],
                   "load_wait_ms": 1000 * statistics.median(waits[name]),
                   "hits": stats[name].cache_hits, "misses": stats[name].cache_misses} for name in modes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from cacheblend_rag import BlendConfig, CacheBlendEngine, FreshSegment, StoredSegment
    from cacheblend_rag.store import ChunkCache, MemoryKVStore
    from cacheblend_rag.store.format.chunk_bytes import decode_manifest
    from cacheblend_rag.store.backends.redis_store import RedisKVStore, redact_url

    server = None if args.url else LocalRedis()
    url = args.url or server.url
    try:
        engine = CacheBlendEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                                  config=BlendConfig(recompute_ratio=args.ratio))
        chunks, head, tail, source = load_prompt(engine, args)
        stored = [FreshSegment(head), *(StoredSegment(c) for c in chunks), FreshSegment(tail)]
        torch.set_grad_enabled(False)
        report: dict = {
            "benchmark": "redis", "model": engine.model_name, "device": str(engine.device), "dtype": str(engine.dtype),
            "data": source, "chunks": len(chunks), "chunk_tokens": [len(c) for c in chunks],
            "prompt_tokens": sum(len(s.token_ids) for s in stored), "recompute_ratio": args.ratio,
            "repeats": args.repeats, "redis": redact_url(url), "redis_server": "local loopback" if server else "given",
            "ttft": {},
        }
        if server:
            report["redis_version"] = server.version

        full = [t for s in stored for t in s.token_ids]
        times = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            engine.full_prefill(full)
            times.append(time.perf_counter() - start)
        report["ttft"]["full_prefill"] = {"ttft_ms": 1000 * statistics.median(times[1:])}

        memory = ChunkCache(engine, MemoryKVStore(), resident_bytes=0)
        memory.warm(chunks)
        store = RedisKVStore(url, prefix=f"bench-{uuid.uuid4().hex[:8]}")
        piped = ChunkCache(engine, store, resident_bytes=0)
        summary = piped.warm(chunks)
        unpiped = ChunkCache(engine, store, prefetch=False, resident_bytes=0)
        report["ttft"].update(time_modes(engine, {"memory_tier": (stored, memory), "redis_pipelined": (stored, piped),
                                                  "redis_no_prefetch": (stored, unpiped)}, args.repeats))

        keys = [piped.key_for(c) for c in chunks]
        manifests = [decode_manifest(m) for m in store.get_manifests(keys)]
        reads = []
        for layer in range(engine.num_layers):
            start = time.perf_counter()
            store.get_layers([(k, m.write_id, layer) for k, m in zip(keys, manifests)])
            reads.append(time.perf_counter() - start)
        report["redis_layer_read_ms"] = 1000 * statistics.median(reads)
        report["bytes_per_blend"] = summary.bytes_written
        report["bytes_per_token"] = summary.bytes_written / sum(len(c) for c in chunks)

        mem_ms = report["ttft"]["memory_tier"]["ttft_ms"]
        report["redis_pipelined_over_memory"] = report["ttft"]["redis_pipelined"]["ttft_ms"] / mem_ms
        report["redis_no_prefetch_over_memory"] = report["ttft"]["redis_no_prefetch"]["ttft_ms"] / mem_ms
        for cache in (memory, piped, unpiped):
            cache.flush()
        store.clear()
        store.close()
        memory.close()
    finally:
        if server:
            server.stop()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
