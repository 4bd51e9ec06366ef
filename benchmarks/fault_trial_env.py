"""The fault trial's cases about the machine rather than the bytes: real small file systems (tmpfs
mounts: full at open, full during write-back, read-only), a store folder removed while open, a writer
killed mid-warm, and a real redis-server that hangs (SIGSTOP), dies mid-layer, or is flushed; then
16 concurrent requests through each integration. Imported by ``fault_trial.py``."""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from cacheblend_rag.store import ChunkCache, DiskKVStore

REDIS_HELPERS = Path(__file__).resolve().parents[1] / "tests" / "store_redis"
READ_TIMEOUT, PROBE_INTERVAL = 0.5, 1.0


def _value_files(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*.val")}


def _named_files(path: Path) -> set[str]:
    import sqlite3

    with sqlite3.connect(f"{(path / 'cache.db').as_uri()}?mode=ro", uri=True) as con:  # WAL included
        return {n for (n,) in con.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")}


class _Tmpfs:
    """A tmpfs of ``size`` mounted on ``folder`` for one case (needs root)."""

    def __init__(self, folder: Path, size: int) -> None:
        self.folder = folder

        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"cannot mount a tmpfs ({done.stderr.strip()}); run the trial as root")

    def fill(self, leave: int = 0) -> Path:
        """Fill the file system with an unrelated file, leaving about ``leave`` bytes."""
        filler = self.folder / "unrelated-file"
        free = shutil.disk_usage(self.folder).free - leave
        with open(filler, "wb") as f:
            try:
                while free > 0:
                    f.write(b"\0" * min(free, 1 << 20))
                    f.flush()
                    free -= 1 << 20
            except OSError:
                pass
        return filler

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.folder)], check=True, capture_output=True)

    def __enter__(self) -> "_Tmpfs":
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", "-l", str(self.folder)], capture_output=True)


def _row(name: str, run: Callable[[], dict[str, Any]], trial: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"fault": name}
    try:
        row.update(run())
    except Exception as exc:  # a request that fails is what the trial looks for
        row.update(survived=False, error=f"{type(exc).__name__}: {exc}"[:300])
    row["outside_file_intact"] = trial.victim.read_text() == "precious"
    row["survived"] = bool(row.get("survived")) and row["outside_file_intact"]
    return row


def _same(trial: Any, logits: torch.Tensor, text: str, tolerance: float) -> bool:
    return text == trial.healthy_text and float((logits - trial.healthy).abs().max()) <= tolerance


# --------------------------------------------------------------------------- file systems
def file_system_faults(trial: Any, answer: Callable, cache_for: Callable, tolerance: float) -> list[dict[str, Any]]:
    root = trial.work / "fs"
    stored = sum(f.stat().st_size for f in trial.pristine.rglob("*") if f.is_file())
    room = stored + (4 << 20)  # the healthy store and a little more

    def full_at_open() -> dict[str, Any]:
        with _Tmpfs(root, room) as fs:
            path = fs.folder / "kv"
            shutil.copytree(trial.pristine, path)
            files = _value_files(path)
            filler = fs.fill()
            with cache_for(path) as cache:
                logits, text, stats = answer(cache)
                entries = cache.stats().entries
            intact = _value_files(path) == files and not [n for n in os.listdir(path) if "broken" in n]
            filler.unlink()
            with cache_for(path) as cache:  # space is back: the next replica writes again
                recovered = cache.stats().details.get("writes") == "ok"
            same = _same(trial, logits, text, tolerance)
            return dict(answer_same=same, hits=stats.cache_hits, entries=entries, nothing_deleted=intact,
                        writes_after_space_returns=recovered,
                        survived=same and intact and entries == 4 and stats.cache_hits == 4 and recovered)

    def full_at_write_back() -> dict[str, Any]:
        with _Tmpfs(root, room) as fs:
            path = fs.folder / "kv"
            with cache_for(path) as cache:
                filler = fs.fill(leave=stored // 3)  # room for about one chunk of the four
                logits, text, stats = answer(cache)
                cache.flush()
                skipped = cache.stats().writes_skipped
            filler.unlink()  # so that the index, WAL included, can be read to compare
            leftovers = _value_files(path) - _named_files(path)
            same = _same(trial, logits, text, tolerance)
            return dict(answer_same=same, writes_skipped=skipped, files_left_by_failed_writes=len(leftovers),
                        survived=same and not leftovers)

    def read_only() -> dict[str, Any]:
        with _Tmpfs(root, room) as fs:
            path = fs.folder / "kv"
            shutil.copytree(trial.pristine, path)
            fs.remount("ro")
            with cache_for(path) as cache:
                logits, text, stats = answer(cache)
                entries = cache.stats().entries
            fs.remount("rw")  # close() released every handle, or this would be "busy"
            same = _same(trial, logits, text, tolerance)
            return dict(answer_same=same, hits=stats.cache_hits, entries=entries,
                        survived=same and stats.cache_hits == 4 and entries == 4)

    def folder_removed() -> dict[str, Any]:
        path = trial.work / "removed"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(trial.pristine, path)
        with cache_for(path) as cache:
            answer(cache)
            shutil.rmtree(path)
            logits, text, _ = answer(cache)
            cache.flush()
        with cache_for(path) as cache:
            entries = cache.stats().entries  # written anew, not into the deleted index
        same = _same(trial, logits, text, tolerance)
        return dict(answer_same=same, entries_after=entries, survived=same and entries == 4)

    def killed_mid_warm() -> dict[str, Any]:
        path = trial.work / "killed"
        shutil.rmtree(path, ignore_errors=True)
        child = subprocess.Popen([sys.executable, __file__, "warm-slowly", str(path), repr(trial.chunks),
                                  trial.model or ""],
                                 stdout=subprocess.PIPE, text=True)
        said = [child.stdout.readline().split() for _ in range(2)]
        assert [words[:2] for words in said] == [["chunk", "0"], ["chunk", "1"]]  # two chunks complete
        # Up to what the second chunk took (the first also paid for the first forward) times 1.6, so
        # that the kill lands while the last two are being warmed, whatever the chunks' length.
        time.sleep(random.uniform(0.2, 1.6) * float(said[1][2]))
        child.send_signal(signal.SIGKILL)
        child.wait()
        complete = 2 + len(child.stdout.read().splitlines())
        with cache_for(path) as cache:
            logits, text, stats = answer(cache)
            cache.flush()
            after = cache.stats()
        same = _same(trial, logits, text, tolerance)
        return dict(answer_same=same, hits=stats.cache_hits, corrupt=after.corrupt, chunks_complete_at_kill=complete,
                    survived=same and stats.cache_hits >= 1 and after.corrupt == 0 and after.entries == 4)

    cases = {"full disk (tmpfs) at open": full_at_open, "full disk (tmpfs) during write-back": full_at_write_back,
             "read-only file system": read_only, "store folder removed while open": folder_removed,
             "kill -9 during warm, then reopen": killed_mid_warm}
    return [_row(name, run, trial) for name, run in cases.items()]


def trial_engine(model: str | None) -> Any:
    """The trial's engine: the embedded model (``None``), a ``tiny-*`` random test model (seeded: a child
    process builds the very same weights), or any name or path the loader takes."""
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.serving.engine_key import is_tiny_model_name
    from cacheblend_rag.serving.registry import tiny_engine_named

    if model and is_tiny_model_name(model):
        return tiny_engine_named(model)
    return CacheBlendEngine.from_pretrained(model, min_blend_tokens=0)  # None: the embedded model


def _warm_slowly(path: str, chunks: str, model: str) -> None:
    """The child of ``killed_mid_warm``: warms chunk by chunk, saying when each is complete."""
    engine = trial_engine(model or None)
    with ChunkCache(engine, DiskKVStore(path), storage_dtype="float32") as cache:
        for i, ids in enumerate(eval(chunks)):  # noqa: S307  (our own list of ints)
            started = time.perf_counter()
            cache.warm([ids])
            print(f"chunk {i} {time.perf_counter() - started:.3f}", flush=True)


# --------------------------------------------------------------------------- Redis
def redis_faults(trial: Any, answer: Callable, tolerance: float) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REDIS_HELPERS))
    from redis_server import RedisServer  # noqa: E402

    from cacheblend_rag.store.backends.redis_store import RedisKVStore

    server = RedisServer(trial.work / "redis").start()

    def cache() -> ChunkCache:
        store = RedisKVStore(server.url(), read_timeout=READ_TIMEOUT, probe_interval=PROBE_INTERVAL)
        warmed = ChunkCache(trial.engine, store, storage_dtype="float32", resident_bytes=0)  # the store's paths
        warmed.warm(trial.chunks)
        return warmed

    def timed(c: ChunkCache, n: int) -> tuple[list[float], list[Any]]:
        times, results = [], []
        for _ in range(n):
            started = time.monotonic()
            results.append(answer(c, blend_only=True))
            times.append(time.monotonic() - started)
        return times, results

    def p95(times: list[float]) -> float:
        return sorted(times)[max(0, int(round(0.95 * len(times))) - 1)]

    def timed_cold(c: ChunkCache, n: int) -> list[float]:
        times = []
        for _ in range(n):  # a healthy server that holds none of the chunks: each is computed fresh
            c.flush()
            c.store.clear()
            started = time.monotonic()
            answer(c, blend_only=True)
            times.append(time.monotonic() - started)
        return times

    def hung() -> dict[str, Any]:
        with cache() as c:
            healthy, _ = timed(c, 8)
            cold = timed_cold(c, 8)
            c.flush()
            server.process.send_signal(signal.SIGSTOP)
            try:
                stopped, results = timed(c, 8)
                available = c.stats().available
            finally:
                server.process.send_signal(signal.SIGCONT)
            back = time.monotonic()
            while c.store._down is not None and time.monotonic() - back < 10:
                time.sleep(0.05)
            resumed = time.monotonic() - back
            hits = answer(c, blend_only=True)[2].cache_hits
        same = all(float((r[0] - trial.healthy).abs().max()) <= tolerance for r in results)
        # Stopped, every chunk is computed fresh: a stopped request is a cold one (a healthy server that
        # holds none of the chunks) plus the one wait the outage may cost; a second wait is the failure
        # to catch. Medians, decided at the midpoint between one wait and two: the cold and the stopped
        # requests run one after the other, and a p95 (of 8, the slowest) picks up whatever the other
        # test worker did at that moment (a p95 bound failed one full `make test` at 2.00 s against
        # 1.88 s, a request 0.75 s over the cold ones: one wait and load, not two waits).
        cold_median, stopped_median = statistics.median(cold), statistics.median(stopped)
        bound = cold_median + 1.5 * READ_TIMEOUT
        return dict(answer_same=same, healthy_p95_s=round(p95(healthy), 2), cold_median_s=round(cold_median, 2),
                    cold_p95_s=round(p95(cold), 2), stopped_median_s=round(stopped_median, 2),
                    stopped_p95_s=round(p95(stopped), 2), bound_s=round(bound, 2),
                    stats_while_stopped="unavailable" if not available else "available",
                    hits_resumed_after_s=round(resumed, 2), hits_after=hits,
                    survived=same and stopped_median <= bound and resumed <= PROBE_INTERVAL + READ_TIMEOUT
                    and hits == 4 and not available)

    def answered_through(c: ChunkCache, method: str, replacement: Callable) -> dict[str, Any]:
        """A blend with the store's ``method`` replaced: every chunk must be a load failure, none a hit."""
        real = getattr(RedisKVStore, method)
        setattr(RedisKVStore, method, replacement)
        try:
            logits, _, stats = answer(c, blend_only=True)
        finally:
            setattr(RedisKVStore, method, real)
            c.close()
        same = float((logits - trial.healthy).abs().max()) <= tolerance
        return dict(answer_same=same, hits=stats.cache_hits, load_failures=stats.load_failures,
                    load_recompute_s=round(stats.timings.get("load_recompute", 0.0), 2),
                    survived=same and stats.cache_hits == 0 and stats.load_failures == 4)

    def killed_mid_layer() -> dict[str, Any]:
        c = cache()
        real, calls = RedisKVStore.get_layers, []

        # The 10th of SmolLM2's 30 layer reads; a third of the way through another model's (a tiny one's 2nd of 4).
        at = max(2, min(10, trial.engine.model.config.num_hidden_layers // 3))

        def dies_a_third_of_the_way(self, requests):
            calls.append(1)
            if len(calls) == at:
                server.kill()
            return real(self, requests)

        try:
            return answered_through(c, "get_layers", dies_a_third_of_the_way)
        finally:
            if len(calls) >= at:  # killed: back for the next case (a server still running is not started twice)
                server.start()

    def flushed_mid_read() -> dict[str, Any]:
        c = cache()
        real = RedisKVStore.get_manifests

        def flush_after(self, keys):
            manifests = real(self, keys)
            self._client.flushall()
            return manifests

        return answered_through(c, "get_manifests", flush_after)

    def random_flushes() -> dict[str, Any]:
        c = cache()
        stop = threading.Event()

        def flusher() -> None:
            with server.client() as admin:
                while not stop.wait(random.uniform(0.05, 0.4)):
                    admin.flushall()

        thread = threading.Thread(target=flusher, daemon=True)
        thread.start()
        try:
            times, results = timed(c, 5)
        finally:
            stop.set()
            thread.join()
            c.close()
        same = all(float((r[0] - trial.healthy).abs().max()) <= tolerance for r in results)
        return dict(answer_same=same, seconds=[round(t, 1) for t in times],
                    load_failures=sum(r[2].load_failures for r in results), survived=same)

    cases = {"Redis hung (SIGSTOP), then back (SIGCONT)": hung,
             "Redis killed at the 10th layer read (a third of the way)": killed_mid_layer,
             "Redis keys flushed between manifest and layer reads": flushed_mid_read,
             "Redis FLUSHALL at random 0.05-0.4 s intervals": random_flushes}
    try:
        return [_row(name, run, trial) for name, run in cases.items()]
    finally:
        server.stop()


# --------------------------------------------------------------------------- load
def load_case(trial: Any, passages: list[str], questions: list[str]) -> list[dict[str, Any]]:
    """16 concurrent requests through each integration against one disk store and one Redis: the answers
    must equal the same requests run alone."""
    sys.path.insert(0, str(REDIS_HELPERS))
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM
    from redis_server import RedisServer  # noqa: E402

    server = RedisServer(trial.work / "redis-load").start()
    prompts = [f"Passages:\n{''.join(passages[i:i + 2])}\nQuestion: {q}\nAnswer:" for i, q in enumerate(questions)]
    rows = []
    try:
        for store in (str(trial.work / "load-disk"), server.url()):
            kind = "disk" if "://" not in store else "Redis"
            for name, make, ask in (
                ("LlamaIndex", lambda s: CacheBlendLLM.from_engine(trial.engine, store_path=s, max_new_tokens=6,
                                                                   temperature=0.0, min_blend_tokens=0),
                 lambda llm, p: llm.complete(p).text),
                ("LangChain", lambda s: ChatCacheBlend(engine=trial.engine, store_path=s, max_tokens=6,
                                                       temperature=0.0, min_blend_tokens=0),
                 lambda llm, p: llm.invoke(p).content),
            ):
                def run(make=make, ask=ask, store=store) -> dict[str, Any]:
                    llm = make(store)
                    llm.announce_chunks(passages)
                    alone = [ask(llm, p) for p in prompts]
                    started = time.monotonic()
                    with ThreadPoolExecutor(max_workers=16) as pool:
                        together = list(pool.map(lambda p: ask(llm, p), prompts * (16 // len(prompts))))
                    same = together == alone * (16 // len(prompts))
                    return dict(answer_same=same, requests=len(together), seconds=round(time.monotonic() - started, 1),
                                survived=same)

                rows.append(_row(f"16 concurrent requests, {name}, {kind} store", run, trial))
    finally:
        server.stop()
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["warm-slowly"]:
    _warm_slowly(sys.argv[2], sys.argv[3], sys.argv[4])
