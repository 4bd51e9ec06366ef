"""The replica soak's parts that touch the running app (imported by ``soak_replicas.py``): soak_traffic's clients
asking over HTTP, the engine replicas' processes sampled, soak_faults' runner with a replica kill added, and the
lull in which RSS is read with nothing running."""

from __future__ import annotations

import signal
import statistics
import threading
import time
from collections import Counter
from typing import Any

import httpx
import psutil

from soak_faults import FaultRunner, Phase
from soak_traffic import CLEAR_MESSAGE_CHARS, CLIENTS, Traffic

from cacheblend_rag.serving.remote import sse_chunks

# soak_traffic's 16 clients over HTTP: its calls that return whole ask for whole answers, its streams stream, those it
# cancels or drops close the stream after the first text; its chats ask over unwarmed passages, its control a RAG
# question. (Its own modes stay valid: Traffic.prime sends one request per soak_traffic client.)
HTTP_MODES = {"sync": "whole", "async": "whole", "stream": "stream", "stream-cancel": "stream-cancel",
              "async-stream-drop": "stream-cancel"}
HTTP_CLIENTS = [(HTTP_MODES[mode], "miss" if kind in ("miss", "chat") else "rag") for _, mode, kind in CLIENTS]
REPLACE_TIMEOUT_S = 180.0
KILL_WAIT_S = 15.0  # the kill waits at most this long for its victim to be computing (a request in flight)
SETTLE_S = 2.0  # in a lull, after the last answer: the replicas' schedulers go idle and trim their heaps


class HttpTraffic(Traffic):
    """soak_traffic's clients (their Poisson schedule, lulls, records, deadline), asking the server over HTTP."""

    def __init__(self, url: str, corpus: Any, *, rate: float, seed: int, deadline_s: float, max_tokens: int) -> None:
        super().__init__({}, corpus, rate=rate, seed=seed, deadline_s=deadline_s, reference={},
                         started=time.monotonic())
        self.url, self.max_tokens = url + "/v1/chat/completions", max_tokens
        self.first_seen: dict[str, float] = {}  # replica id -> when it first answered
        self.answered: Counter[str] = Counter()  # replica id -> answers
        self._local, self._clients = threading.local(), []

    def start(self) -> None:
        for index, (mode, kind) in enumerate(HTTP_CLIENTS):
            thread = threading.Thread(target=self._client, args=(index, "http", mode, kind), daemon=True,
                                      name=f"soak-client-{index}")
            thread.start()
            self._threads.append(thread)

    def in_flight(self) -> int:
        with self._lock:
            return sum(r.outcome == "in flight" for r in self.records)

    def paused(self) -> bool:
        return not self._go.is_set()

    def seen(self) -> tuple[dict[str, float], Counter[str]]:
        """Each replica id that answered: when it first did, and how many times."""
        with self._lock:
            return dict(self.first_seen), Counter(self.answered)

    def restart_clock(self) -> None:
        """After :meth:`prime`: the clock starts now, the records and answer counts empty."""
        with self._lock:
            self.records.clear()
            self.started = time.monotonic()
            self.first_seen, self.answered = dict.fromkeys(self.first_seen, 0.0), Counter()

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def _prompt(self, rng: Any, kind: str, history: Any) -> tuple[dict[str, Any], int, list[str]]:
        if kind == "miss":  # two passages no request asked before (soak_traffic's cold pool, in turn)
            with self._lock:
                at, self._cold = self._cold, self._cold + 2
            cold = self.corpus.cold
            documents, question = [cold[(at + i) % len(cold)] for i in range(2)], rng.choice(self.corpus.questions)
        else:
            q = rng.randrange(len(self.corpus.questions))
            documents = rng.sample(self.corpus.warm[q], k=min(len(self.corpus.warm[q]), rng.choice([2, 3])))
            question = self.corpus.questions[q]
        body = {"messages": [{"role": "user", "content": f"{question}\nAnswer in a few words."}],
                "documents": documents, "max_tokens": self.max_tokens, "temperature": 0.0}
        return body, len(documents), []

    def _run(self, record: Any, loop: Any, prompt: dict[str, Any], turns: Any, framework: str, mode: str,
             kind: str) -> None:
        begun = time.monotonic()
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(timeout=httpx.Timeout(self.deadline_s, connect=10.0))
            self._clients.append(client)
        mode = HTTP_MODES.get(mode, mode)
        try:
            if mode == "whole":
                outcome, ttft, stats, failure = _whole(client, self.url, prompt, begun)
            else:
                body = {**prompt, "stream": True, "stream_options": {"include_usage": True}}
                outcome, ttft, stats, failure = _stream(client, self.url, body, mode == "stream-cancel", begun)
        except httpx.TimeoutException:
            self._finish(record, begun, "hang", error=f"no answer within the {self.deadline_s:.0f} s deadline")
            return
        except httpx.HTTPError as exc:  # the connection itself failed: no error body, so not a clear error
            self._finish(record, begun, "error", error=f"{type(exc).__name__}: {exc}"[:400], clear=False)
            return
        record.stats, record.text = stats, stats.pop("text", "")
        if failure is not None:
            self._finish(record, begun, "error", error=failure[0], clear=failure[1])
            return
        record.ttft = round(ttft, 4)
        if stats.get("replica"):
            with self._lock:
                self.first_seen.setdefault(stats["replica"], self.now())
                self.answered[stats["replica"]] += 1
        self._finish(record, begun, outcome)


def _failed(status: int, body: Any, replica: str | None) -> tuple[str, None, dict[str, Any], tuple[str, bool]]:
    """An answer that is an error: its code, and whether it is clear (OpenAI's shape, a message that says something)."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    code, message = error.get("code"), str(error.get("message") or "")
    clear = bool(code or error.get("type")) and len(message) >= CLEAR_MESSAGE_CHARS
    return "error", None, {"replica": replica, "error_code": code}, (f"{status} {code}: {message or body}"[:400], clear)


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:300]


def _whole(client: httpx.Client, url: str, body: dict[str, Any], begun: float) -> tuple:
    response = client.post(url, json=body)
    replica = response.headers.get("x-cacheblend-replica")
    if response.status_code != 200:
        return _failed(response.status_code, _body(response), replica)
    answer = response.json()
    stats = {"replica": replica, **(answer.get("cacheblend") or {}),
             "text": answer["choices"][0]["message"].get("content") or ""}
    # A whole answer shows no first token: the engine's own time to it, as soak_traffic reads it.
    return "answer", stats.get("ttft_s", time.monotonic() - begun), stats, None


def _stream(client: httpx.Client, url: str, body: dict[str, Any], cancel: bool, begun: float) -> tuple:
    with client.stream("POST", url, json=body) as response:
        replica = response.headers.get("x-cacheblend-replica")
        if response.status_code != 200:
            response.read()
            return _failed(response.status_code, _body(response), replica)
        ttft, text, stats = None, "", {}
        for chunk in sse_chunks(response.iter_lines()):
            if "error" in chunk:  # the replica stopped mid-stream, or the server failed the request
                return _failed(200, chunk, replica)
            for choice in chunk.get("choices") or ():
                text += (choice.get("delta") or {}).get("content") or ""
            if ttft is None and text:
                ttft = time.monotonic() - begun
                if cancel:  # closing the response drops the connection: the replica cancels the request
                    return "cancelled", ttft, {"replica": replica, "text": text}, None
            stats = chunk.get("cacheblend") or stats
    if not stats:
        return "error", None, {"replica": replica}, ("the stream ended without its usage chunk", False)
    return "answer", ttft if ttft is not None else time.monotonic() - begun, {"replica": replica, **stats,
                                                                              "text": text}, None


class EngineSampler:
    """Each engine replica's process (descendants of serve titled CacheBlendEngine): RSS, open files, threads."""

    def __init__(self, root: int, now: Any) -> None:
        self.root, self.now = psutil.Process(root), now
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def pids(self) -> list[int]:
        found = []
        for process in self.root.children(recursive=True):
            try:
                if any("CacheBlendEngine" in part for part in process.cmdline()):
                    found.append(process.pid)
            except psutil.Error:
                continue
        return sorted(found)

    def _numbers(self) -> dict[int, tuple[int, int, int]]:
        out = {}
        for pid in self.pids():
            try:
                p = psutil.Process(pid)
                out[pid] = (p.memory_info().rss, p.num_fds(), p.num_threads())
            except psutil.Error:
                continue
        return out

    def sample(self) -> None:
        numbers = self._numbers()
        self.samples.append({"t": round(self.now(), 2), **{k: sum(n[i] for n in numbers.values()) for i, k in
                                                            enumerate(("rss_bytes", "fds", "threads"))},
                             "engines": {str(pid): n[0] for pid, n in numbers.items()}})

    def read_rss(self) -> dict[str, int]:
        """Each engine's RSS, the median of three readings 0.1 s apart."""
        readings = []
        for _ in range(3):
            readings.append({pid: n[0] for pid, n in self._numbers().items()})
            time.sleep(0.1)
        return {str(pid): int(statistics.median(r.get(pid, 0) for r in readings)) for pid in readings[-1]}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()


class ReplicaFaults(FaultRunner):
    """soak_faults' runner for the kept faults, plus ``replica_kill``."""

    def __init__(self, env: Any, traffic: HttpTraffic, phases: list[Phase], *, seed: int,
                 sampler: EngineSampler) -> None:
        super().__init__(env, traffic, phases, seed=seed, warm_job=None, disk_full=None, live_keys=list)
        self.sampler, self.kill, self.ids_before = sampler, {}, set()

    def replica_kill(self, phase: Phase) -> None:
        pids = self.sampler.pids()
        if len(pids) < 2:
            raise RuntimeError(f"found {len(pids)} engine processes, not 2")
        victim = psutil.Process(self.rng.choice(pids))
        busy, waited = False, time.monotonic()
        while not busy and time.monotonic() - waited < KILL_WAIT_S:  # requests in flight, and the victim computing
            before = sum(victim.cpu_times()[:2])
            time.sleep(0.1)
            busy = not self.traffic.paused() and self.traffic.in_flight() > 0 and \
                sum(victim.cpu_times()[:2]) - before > 0.03
        self.ids_before = set(self.traffic.seen()[0])
        in_flight, rss = self.traffic.in_flight(), victim.memory_info().rss
        victim.send_signal(signal.SIGKILL)
        self.kill = {"victim_pid": victim.pid, "killed_at_s": round(self.traffic.now(), 3), "victim_busy": busy,
                     "in_flight_at_kill": in_flight, "victim_rss_mb": round(rss / 2**20, 1)}
        phase.details.update(self.kill)
        deadline = time.monotonic() + REPLACE_TIMEOUT_S
        while len(new := [p for p in self.sampler.pids() if p != victim.pid]) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray did not start a replacement within {REPLACE_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        # Ray's first attempt; the report names the replacement alive at the end (an attempt may fail to start).
        self.kill.update(first_replacement_pid=sorted(set(new) - set(pids))[0],
                         two_engines_again_at_s=round(self.traffic.now(), 3))
        phase.details.update(self.kill)

    def replacement(self) -> tuple[str | None, float | None, int]:
        """The replica id not seen before the kill that answered first: when it first did, and its answers."""
        seen, answered = self.traffic.seen()
        new = sorted((t, rid) for rid, t in seen.items() if rid not in self.ids_before) if self.kill else []
        return (new[0][1], round(new[0][0], 3), answered[new[0][1]]) if new else (None, None, 0)


def lull(traffic: HttpTraffic, sampler: EngineSampler, what: str, timeout: float) -> dict[str, Any]:
    """Arrivals paused until nothing runs, each engine's RSS read, arrivals resumed."""
    traffic.pause()
    began = time.monotonic()
    while traffic.in_flight() and time.monotonic() - began < timeout:
        time.sleep(0.05)
    idle = not traffic.in_flight()
    time.sleep(SETTLE_S)
    reading = {"what": what, "t": round(traffic.now(), 2), "idle": idle, "waited_s": round(time.monotonic() - began, 2),
               "rss_bytes": sampler.read_rss(), "answers_by_replica": dict(traffic.seen()[1])}
    traffic.resume()
    return reading
