"""``cacheblend-rag serve --ray``: two replicas of a tiny model on a local Ray and the session's Redis.

One app for the whole module (Ray and two replicas take half a minute to start): document sets routed
to one replica each and kept there, a document computed on one replica found in Redis by the other,
a replica killed mid-stream (its streams fail clearly, the other's finish, Ray restarts it, its
documents come back from Redis), and a SIGTERM that leaves none of the command's processes behind.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_process import ServeProcess  # noqa: E402

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow


def _documents(tag: str, n: int = 1) -> list[str]:
    return [f"Passage {tag}-{i}: the {tag} river crosses {i + 3} valleys before the sea. " * 3 for i in range(n)]


def _ask(url: str, documents: list[str], question: str = "Which river?", **extra: object) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}], "documents": documents, "max_tokens": 2, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def _replica(response: httpx.Response) -> str:
    replica = response.json()["cacheblend"]["replica"]
    assert response.headers["x-cacheblend-replica"] == replica
    return replica


def _engine_pids(serve: ServeProcess) -> list[int]:
    """The engine replicas' processes: descendants of this test's own serve process, by Ray's title."""
    return [p.pid for p in psutil.Process(serve.process.pid).children(recursive=True)
            if any("CacheBlendEngine" in part for part in _cmdline(p))]


def _cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory, redis_server):
    with redis_server.client() as client:
        client.flushall()
    log = tmp_path_factory.mktemp("ray-serve") / "serve.log"
    serve = ServeProcess(["--ray", "--replicas", "2", "--model", "tiny-llama", "--store", redis_server.url(),
                          "--port", "0"], log)
    try:
        serve.wait_healthy(timeout=240)
        yield serve
    finally:
        serve.stop()


def test_each_document_set_stays_on_the_replica_it_went_to_first(ray_server):
    first: dict[int, str] = {}
    for round_ in range(2):
        for n in range(10):
            replica = _replica(_ask(ray_server.url, _documents(f"set{n}", 2), question=f"Question {round_}?"))
            assert first.setdefault(n, replica) == replica, f"set {n} moved from {first[n]} to {replica}"
    assert len(set(first.values())) == 2, f"ten document sets all went to one replica: {first}"


def test_a_document_computed_on_one_replica_is_a_store_hit_on_the_other(ray_server):
    placed: dict[str, list[str]] = {}
    for n in range(16):
        documents = _documents(f"solo{n}")
        placed.setdefault(_replica(_ask(ray_server.url, documents)), []).append(documents[0])
    assert len(placed) == 2, f"sixteen single documents all went to one replica: {list(placed)}"
    (home, homes_docs), (other, others_docs) = sorted(placed.items(), key=lambda kv: -len(kv[1]))
    if len(others_docs) < 3:
        pytest.skip(f"the documents split {len(homes_docs)}/{len(others_docs)}; three on each are needed")
    time.sleep(1.0)  # the write-back of the chunk to Redis runs after the answer
    # Three documents held by one replica and one by the other: the router sends the four to the first,
    # which reads the fourth from Redis (written there by the other), computing nothing.
    response = _ask(ray_server.url, [homes_docs[0], *others_docs[:3]], question="And now?")
    stats = response.json()["cacheblend"]
    assert _replica(response) == other
    assert stats["chunk_tiers"]["computed"] == 0, stats["chunk_tiers"]
    assert stats["chunk_tiers"]["store"] >= 1, stats["chunk_tiers"]


def _stream(url: str, documents: list[str], out: dict, started: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "documents": documents,
            "max_tokens": 3000, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            out["status"] = response.status_code
            out["replica"] = response.headers.get("x-cacheblend-replica")
            text = ""
            for line in response.iter_lines():
                if not started.is_set() and line.startswith("data:"):
                    started.set()
                text += line + "\n"
            out["body"] = text
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    started.set()


def test_a_killed_replica_fails_only_its_own_streams_and_comes_back_with_the_store(ray_server):
    sets = [_documents(f"kill{n}", 2) for n in range(8)]
    owner = {n: _replica(_ask(ray_server.url, documents)) for n, documents in enumerate(sets)}
    if len(set(owner.values())) < 2:
        pytest.skip("the eight sets all went to one replica")
    results = [dict() for _ in sets]
    started = [threading.Event() for _ in sets]
    threads = [threading.Thread(target=_stream, args=(ray_server.url, documents, results[n], started[n]))
               for n, documents in enumerate(sets)]
    for thread in threads:
        thread.start()
    for event in started:
        event.wait(60)
    victim_pid = _engine_pids(ray_server)[0]
    psutil.Process(victim_pid).send_signal(signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    survivors = {r.get("replica") for r in results if r.get("body", "").rstrip().endswith("data: [DONE]")}
    failed = [r for r in results if not r.get("body", "").rstrip().endswith("data: [DONE]")]
    assert failed, "killing a replica mid-stream failed none of its streams: was it idle?"
    for r in failed:  # a clear error, in the stream's own format, or a 5xx
        assert r.get("status", 500) >= 500 or "replica_failed" in r.get("body", ""), r
    assert not survivors & {r.get("replica") for r in failed}, "a replica both finished and failed streams"
    # Ray restarts the replica; the sets it held come back from Redis, none computed again.
    deadline = time.monotonic() + 180
    while len(_engine_pids(ray_server)) < 2:
        assert time.monotonic() < deadline, "Ray did not restart the killed replica"
        time.sleep(1)
    lost = [n for n, r in enumerate(results) if r in failed]
    for n in lost:
        for _attempt in range(60):
            response = httpx.post(f"{ray_server.url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Again?"}], "documents": sets[n], "max_tokens": 2})
            if response.status_code == 200:
                break
            time.sleep(1)
        assert response.status_code == 200, response.text
        tiers = response.json()["cacheblend"]["chunk_tiers"]
        assert tiers["computed"] == 0, (n, tiers)


def test_sigterm_stops_every_process_the_command_started(ray_server):
    descendants = psutil.Process(ray_server.process.pid).children(recursive=True)
    assert len(descendants) >= 4, "Ray's processes are not the command's own descendants"
    assert ray_server.terminate(timeout=120) == 0, ray_server.log.read_text()[-3000:]
    _, alive = psutil.wait_procs(descendants, timeout=30)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {[(p.pid, _cmdline(p)[:2]) for p in alive]}"
