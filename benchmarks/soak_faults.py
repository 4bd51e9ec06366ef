"""The soak's fault schedule: seven faults in a seeded order at seeded times, phase lengths scaled with the
soak's length (``--minutes 1`` still runs every fault, shorter), and what each does. Imported by ``soak.py``;
run as ``soak_faults.py warm-job ...`` it is the warm job that gets killed."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

# name -> (what it is, seconds it lasts in a 10-minute soak; 0: an event)
FAULTS: dict[str, tuple[str, float]] = {
    "redis_sigstop": ("Redis SIGSTOP for 5 s, then SIGCONT", 5.0),
    "redis_restart": ("Redis killed (SIGKILL) and restarted empty", 0.0),
    "flushall": ("Redis FLUSHALL", 0.0),
    "disk_full": ("the disk tier's file system full", 30.0),
    "rogue_writer": ("a rogue writer plants corrupt and foreign values under live keys", 0.0),
    "warm_job_killed": ("a warm job killed with kill -9 mid-write", 0.0),
    "burst": ("a burst of 3x the arrival rate", 30.0),
}
BURST_FACTOR = 3.0
MIN_GAP_S = 3.0  # healthy time after each fault at the least, so that recovery can be seen
# What an event takes besides its planned 0 s (a restart; the warm job to its kill), in the schedule's reckoning.
EVENT_S = {"warm_job_killed": 3.0}


@dataclass
class Phase:
    """One fault: when it was planned, when it began and cleared (measured), and what it did."""

    name: str
    label: str
    planned_at: float
    planned_s: float
    began: float | None = None
    cleared: float | None = None
    ends: float | None = None  # the next phase's start (or the soak's end): this phase's requests end here
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def schedule(minutes: float, seed: int) -> tuple[float, list[Phase]]:
    """The warm-up's end and the seven faults, in an order and at offsets drawn from ``seed``."""
    total = minutes * 60
    scale = minutes / 10
    rng = random.Random(seed)
    lasting = {name: (5.0 if name == "redis_sigstop" else max(5.0, seconds * scale)) if seconds else 0.0
               for name, (_, seconds) in FAULTS.items()}
    warmup = max(8.0, 0.15 * total)
    order = list(FAULTS)
    rng.shuffle(order)
    events = {name: EVENT_S.get(name, 1.0) for name in order}
    gap = (total - warmup - sum(lasting.values()) - sum(events.values())) / len(order)
    if gap < MIN_GAP_S:
        raise SystemExit(f"--minutes {minutes} is too short for seven faults with {MIN_GAP_S:.0f} s of recovery "
                         "each; pass --minutes 1 or more")
    phases, at = [], warmup
    for name in order:
        offset = rng.uniform(0.0, 0.2 * gap)  # seeded jitter: not every fault on a round second
        phases.append(Phase(name, FAULTS[name][0], round(at + offset, 2), lasting[name]))
        at += lasting[name] + events[name] + gap
    return warmup, phases


class FaultRunner:
    """Runs ``phases`` on a thread of its own against the soak's environment and traffic."""

    def __init__(self, env: Any, traffic: Any, phases: list[Phase], *, seed: int, warm_job: "WarmJob",
                 disk_full: Callable[[Any], Any], live_keys: Callable[[], list[str]]) -> None:
        self.env, self.traffic, self.phases = env, traffic, phases
        self.rng = random.Random(seed + 1)
        self.warm_job = warm_job
        self._fill_disk = disk_full
        self.live_keys = live_keys
        self.damaged_on_disk: set[str] = set()  # destroyed on purpose: not counted as lost
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        for phase in self.phases:
            wait = phase.planned_at - self.traffic.now()
            if wait > 0:
                time.sleep(wait)
            phase.began = round(self.traffic.now(), 3)
            try:
                getattr(self, phase.name)(phase)
            except Exception as exc:  # the soak's own failure to inject: reported, the soak goes on
                self.errors.append(f"{phase.name}: {type(exc).__name__}: {exc}")
                phase.details["injection_error"] = f"{type(exc).__name__}: {exc}"
            phase.cleared = round(self.traffic.now(), 3)

    # ------------------------------------------------------------ the faults
    def redis_sigstop(self, phase: Phase) -> None:
        process = self.env.redis.process
        process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(phase.planned_s)
        finally:
            process.send_signal(signal.SIGCONT)

    def redis_restart(self, phase: Phase) -> None:
        self.env.redis.kill()
        self.env.redis.start()
        with self.env.redis.client() as client:
            phase.details["keys_after_restart"] = client.dbsize()

    def flushall(self, phase: Phase) -> None:
        with self.env.redis.client() as client:
            phase.details["keys_flushed"] = client.dbsize()
            client.flushall()

    def disk_full(self, phase: Phase) -> None:
        with self._fill_disk(self.env) as how:
            phase.details["how"] = how
            time.sleep(phase.planned_s)

    def burst(self, phase: Phase) -> None:
        self.traffic.burst = BURST_FACTOR
        try:
            time.sleep(phase.planned_s)
        finally:
            self.traffic.burst = 1.0

    def rogue_writer(self, phase: Phase) -> None:
        """Random bytes and a pickled object as manifests on disk, random bytes and a string of another type in
        Redis, under keys requests are using."""
        from cacheblend_rag.store.format.tampering import manifest_name, write_as_another_program

        keys = sorted(self.live_keys())
        chosen = self.rng.sample(keys, k=min(8, len(keys)))
        on_disk, in_redis = chosen[:4], chosen[4:]
        path = self.env.disk_path / "kv"
        for i, key in enumerate(on_disk):
            value = os.urandom(self.rng.randrange(64, 512)) if i % 2 == 0 else {"foreign": ["pickled", "object"]}
            write_as_another_program(path, manifest_name(key), value, key)
            self.damaged_on_disk.add(key)
        redis_tier = self.env.store.tiers[-1]
        with self.env.redis.client() as client:
            for i, key in enumerate(in_redis):
                name = redis_tier._hash(key)
                if i % 2 == 0:
                    client.hset(name, "m", os.urandom(200))
                else:
                    client.delete(name)
                    client.set(name, pickle.dumps("a value of another program"))
        phase.details.update(corrupt_on_disk=len(on_disk), corrupt_in_redis=len(in_redis))

    def warm_job_killed(self, phase: Phase) -> None:
        phase.details.update(self.warm_job.run_and_kill(self.rng))


class WarmJob:
    """A second process that warms chunks into the same disk tier and Redis, started early (it loads the model)
    and told to begin at its fault; killed with SIGKILL between its first chunk and its last."""

    def __init__(self, disk: Path, redis_url: str, texts: list[str], prefix_ids: tuple[int, ...], dtype: str,
                 model: str) -> None:
        self.child = subprocess.Popen(
            [sys.executable, __file__, "warm-job", str(disk), redis_url, json.dumps(texts), json.dumps(prefix_ids),
             dtype, model], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def wait_ready(self) -> None:
        """Wait for the job to load its model (before the soak's clock starts: it takes a core for seconds)."""
        assert self.child.stdout is not None
        ready = self.child.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the warm job did not start (said {ready!r})")

    def run_and_kill(self, rng: random.Random) -> dict[str, Any]:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write("go\n")
        self.child.stdin.flush()
        first = self.child.stdout.readline().split()
        seconds = float(first[2]) if len(first) == 3 else 1.0
        time.sleep(rng.uniform(0.2, 1.5) * seconds)  # lands within the next chunk's compute or write
        self.child.send_signal(signal.SIGKILL)
        self.child.wait(10)
        complete = 1 + len(self.child.stdout.read().splitlines())
        self.close()
        return {"chunks_complete_at_kill": complete}

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.kill()
            self.child.wait(10)
        for stream in (self.child.stdin, self.child.stdout):
            if stream is not None:
                stream.close()


def _warm_job(disk: str, redis_url: str, texts: str, prefix_ids: str, dtype: str, model: str) -> None:
    """The warm job's process: loads the model, waits for "go", then warms one chunk at a time, saying so."""
    import torch

    torch.set_num_threads(1)
    from cacheblend_rag.serving.registry import shared_engine
    from cacheblend_rag.store import ChunkCache, DiskKVStore
    from cacheblend_rag.store.backends.redis_store import RedisKVStore
    from cacheblend_rag.store.backends.tiered import TieredKVStore

    engine = shared_engine(model, dtype=dtype)
    store = TieredKVStore(DiskKVStore(disk), RedisKVStore(redis_url))
    cache = ChunkCache(engine, store, prefix_ids=json.loads(prefix_ids))
    print("ready", flush=True)
    sys.stdin.readline()
    for i, text in enumerate(json.loads(texts)):
        started = time.perf_counter()
        cache.warm([text])
        print(f"chunk {i} {time.perf_counter() - started:.3f}", flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["warm-job"]:
    _warm_job(*sys.argv[2:8])
