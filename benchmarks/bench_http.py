"""The server side by side: MuSiQue prompts through `cacheblend-rag serve` from 1-16 streaming clients over
loopback, blending against full prefill on the same server, against llama.cpp's OpenAI server on the same GGUF,
and against the same turns in process (prints JSON; issue 68).

Each request is one MuSiQue question (the harness's instruction, ``cacheblend_rag.bench.prompt``) with its
``--passages`` passages sent as ``documents``, in an order shuffled per request (seeded), so that no prompt
repeats another's opening past the template's lead: what is measured is chunk reuse, not a prefix cache. The
passages are warmed into the server's store first (``/v1/documents/warm``: the corpus ingested ahead of
traffic). Full prefill is the same server with ``"cacheblend": {"reuse": false}`` per request (the prompt
computed whole, in the dtype the server picked: bfloat16 where the CPU is faster in it). llama.cpp's server
(``python -m llama_cpp.server``, llama-cpp-python's, ``make peers``) gets the same rendered text: the passages
pasted where our server renders documents (``chat_turn.render_documents``), requests interrupting none.

Client-side TTFT: from sending the request to the first streamed content chunk. For each client count the
three servers take turns (the order rotating per count), each answering ``--requests`` requests (at least one per client) of
``--max-tokens`` greedy tokens from that many concurrent clients; requests per second over that wall time.
At 1 client the in-process path (``run_turn`` on this process's own engine, the same model and warmed
passages) alternates with the HTTP one, request by request: what the HTTP layer costs.

    .venv/bin/python benchmarks/bench_http.py --out docs/data/bench_http.json --plot docs/bench_http.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import DEFAULT_DATA, git_commit  # noqa: E402

from cacheblend_rag.bench.prompt import QUESTION_INSTRUCTION, SYSTEM_INSTRUCTION, load_musique  # noqa: E402
from cacheblend_rag.bench.report import print_report  # noqa: E402
from cacheblend_rag.models.dtype_choice import cpu_model_name  # noqa: E402
from cacheblend_rag.serving.chat_turn import Document, render_documents  # noqa: E402
from cacheblend_rag.serving.remote import sse_chunks  # noqa: E402



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--n", type=int, default=16, help="MuSiQue questions (the first N)")
    p.add_argument("--passages", type=int, default=10)
    p.add_argument("--max-passage-tokens", type=int, default=200,
                   help="passages cut to this many tokens (the harness's 2,100-token prompts; 0: whole)")
    p.add_argument("--clients", default="1,4,8,16", help="comma-separated concurrent client counts")
    p.add_argument("--requests", type=int, default=8,
                   help="requests per client count and server (at least one per client)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch / llama.cpp threads of each server")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp's server out")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.split(",") if c.strip()]
    if min([args.n, args.passages, args.requests, args.max_tokens, *args.client_counts]) < 1:
        p.error("--n, --passages, --requests, --max-tokens and every --clients count must be at least 1")
    return args


# ------------------------------------------------------------------------------------------- the prompts
def requests_for(args: argparse.Namespace, tokenizer: Any) -> tuple[list[dict[str, Any]], list[Document]]:
    """One request body per (question, shuffle): messages and documents; and every passage, for the warm-up."""
    examples = load_musique(args.data, args.n)
    bodies, corpus = [], {}

    def cut(text: str) -> str:
        if not args.max_passage_tokens:
            return text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.max_passage_tokens]
        return tokenizer.decode(ids).strip()

    for i, example in enumerate(examples):
        docs = [Document(cut(text), title) for title, text in example.passages[: args.passages]]
        for d in docs:
            corpus[d.text] = d
        bodies.append({"question": example.question, "documents": docs, "seed": i})
    return bodies, list(corpus.values())


def shuffled(item: dict[str, Any], salt: int) -> list[Document]:
    docs = list(item["documents"])
    random.Random(item["seed"] * 1000 + salt).shuffle(docs)
    return docs


def messages_of(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_INSTRUCTION},
            {"role": "user", "content": QUESTION_INSTRUCTION + question}]


def ours_body(item: dict[str, Any], docs: list[Document], max_tokens: int, reuse: bool) -> dict[str, Any]:
    body = {"messages": messages_of(item["question"]), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "documents": [{"title": d.title, "text": d.text} for d in docs]}
    if not reuse:
        body["cacheblend"] = {"reuse": False}
    return body


def llama_body(item: dict[str, Any], docs: list[Document], max_tokens: int) -> dict[str, Any]:
    # The same text our server renders: the documents opening the last user message.
    messages = messages_of(item["question"])
    messages[-1]["content"] = f"{render_documents(docs)}\n\n{messages[-1]['content']}"
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}


# ------------------------------------------------------------------------------------------- the servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, path: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}{path} not ready in {timeout:.0f} s")


def start_ours(threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cacheblend_rag.cli", "serve", "--port", str(port), "--store",
                             "memory"], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "/health")
    return proc, url


def start_llama_cpp(gguf: Path, threads: int, n_ctx: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
                             "--n_threads_batch", str(threads), "--interrupt_requests", "False"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "/v1/models")
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------- the clients
def stream_request(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: client TTFT (first content chunk), total time, and the server's usage/stats."""
    started = time.perf_counter()
    ttft, usage, stats, text = None, None, None, ""
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return {"error": f"{response.status_code}: {response.text[:300]}"}
        for chunk in sse_chunks(response.iter_lines()):
            if "error" in chunk:
                return {"error": json.dumps(chunk["error"])[:300]}
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text += content
            usage = chunk.get("usage") or usage
            stats = chunk.get("cacheblend") or stats
    total = time.perf_counter() - started
    return {"ttft_s": total if ttft is None else ttft, "total_s": total, "text": text, "usage": usage,
            "server_ttft_s": (stats or {}).get("ttft_s"), "mode": (stats or {}).get("mode")}


def run_level(url: str, bodies: list[dict[str, Any]], clients: int, timeout: float) -> dict[str, Any]:
    """``bodies`` sent by ``clients`` concurrent clients (each takes the next): TTFT p50/p99, requests/s."""
    queue = list(enumerate(bodies))
    lock = threading.Lock()
    results: list[dict[str, Any]] = [{} for _ in bodies]

    def client_loop() -> None:
        with httpx.Client(timeout=timeout) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    index, body = queue.pop(0)
                try:
                    results[index] = stream_request(client, url, body)
                except Exception as error:  # noqa: BLE001 - counted as an error of the run, not raised
                    results[index] = {"error": f"{type(error).__name__}: {error}"[:300]}

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client_loop) for _ in range(clients)]:
            future.result()
    wall = time.perf_counter() - started
    return summarize(results, wall)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    ttfts = [r["ttft_s"] for r in ok]
    served = [r["server_ttft_s"] for r in ok if r.get("server_ttft_s") is not None]
    cached = [((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") for r in ok]
    out = {"requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall, 3),
           "requests_per_s": round(len(ok) / wall, 3) if wall else None}
    if ttfts:
        out.update(ttft_p50_s=round(statistics.median(ttfts), 4), ttft_p99_s=round(percentile(ttfts, 0.99), 4),
                   ttft_mean_s=round(statistics.fmean(ttfts), 4))
    if served:
        out["server_ttft_p50_s"] = round(statistics.median(served), 4)
    if any(c is not None for c in cached):
        out["cached_tokens_mean"] = round(statistics.fmean(c or 0 for c in cached), 1)
    prompt = [(r.get("usage") or {}).get("prompt_tokens") for r in ok if r.get("usage")]
    if prompt:
        out["prompt_tokens_mean"] = round(statistics.fmean(prompt), 1)
    if len(ok) < len(results):
        out["first_error"] = next(r["error"] for r in results if "error" in r)
    return out


# ------------------------------------------------------------------------------------------- in process
def in_process_vs_http(settings: Any, url: str, items: list[dict[str, Any]], corpus: list[Document],
                       args: argparse.Namespace) -> dict[str, Any]:
    """At one client: the same turns through the server and in this process (``settings``: the same model, its
    chunk KV in memory), alternating request by request."""
    from cacheblend_rag.serving import ChatTurn, TextDelta

    settings.precompute_texts([d.text for d in corpus], show_progress=False, for_request=False)
    generation = settings.generation_config_with(args.max_tokens, None, {"temperature": 0})
    rows = {"http": [], "in_process": []}
    with httpx.Client(timeout=args.request_timeout) as client:
        for k, item in enumerate(items * 2):
            docs = shuffled(item, 7000 + k)
            turn = ChatTurn(generation=generation, messages=messages_of(item["question"]),
                            documents=[{"title": d.title, "text": d.text} for d in docs])
            for where in (("http", "in_process") if k % 2 == 0 else ("in_process", "http")):
                if where == "http":
                    rows["http"].append(stream_request(client, url, ours_body(item, docs, args.max_tokens, True)))
                    continue
                started = time.perf_counter()
                ttft = None
                for event in settings.run_turn(turn):
                    if ttft is None and isinstance(event, TextDelta):
                        ttft = time.perf_counter() - started
                total = time.perf_counter() - started
                rows["in_process"].append({"ttft_s": ttft if ttft is not None else total, "total_s": total})
    http = statistics.median(r["ttft_s"] for r in rows["http"] if "error" not in r)
    served = statistics.median(r["server_ttft_s"] for r in rows["http"] if r.get("server_ttft_s") is not None)
    local = statistics.median(r["ttft_s"] for r in rows["in_process"])
    return {"requests_each": len(rows["in_process"]), "http_ttft_p50_s": round(http, 4),
            "http_server_side_ttft_p50_s": round(served, 4),
            "in_process_ttft_p50_s": round(local, 4), "http_over_in_process": round(http / local, 4),
            "errors": sum(1 for r in rows["http"] if "error" in r)}


# ------------------------------------------------------------------------------------------- the run
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cacheblend_rag.serving import CacheBlendSettings

    local = CacheBlendSettings(store_path="memory")  # the in-process side, and the tokenizer that cuts passages
    items, corpus = requests_for(args, local.service.engine.tokenizer)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_http_{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    report: dict[str, Any] = {"benchmark": "http", "cpu": cpu_model_name(), "cores": os.cpu_count(),
                              "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
                              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "data")}}
    try:
        servers["cacheblend"] = start_ours(args.threads, logs / "cacheblend.log")
        url = servers["cacheblend"][1]
        warm = httpx.post(url + "/v1/documents/warm", json={"documents": [{"title": d.title, "text": d.text}
                                                                          for d in corpus]}, timeout=3600).json()
        report["warm"] = warm
        report["model"] = httpx.get(url + "/v1/models").json()["data"][0]
        if not args.no_llama_cpp:
            if importlib.util.find_spec("llama_cpp") is None:
                report["llama_cpp"] = "skipped: llama-cpp-python is not installed (make peers)"
            else:
                from cacheblend_rag.models.loader import default_gguf_path

                servers["llama.cpp"] = start_llama_cpp(default_gguf_path(), args.threads,
                                                       int(report["model"].get("max_model_len") or 8192),
                                                       logs / "llama_cpp.log")
                report["llama_cpp_gguf"] = str(default_gguf_path())
        report["in_process_at_1_client"] = in_process_vs_http(local, url, items[: max(1, args.requests // 2)], corpus,
                                                              args)
        modes = ["blend", "full_prefill", *(["llama.cpp"] if "llama.cpp" in servers else [])]
        levels = []
        for level, clients in enumerate(args.client_counts):
            row: dict[str, Any] = {"clients": clients}
            for turn in range(len(modes)):
                mode = modes[(level + turn) % len(modes)]
                picked = [items[i % len(items)] for i in range(max(args.requests, clients))]
                salt = 100 * (level + 1)
                if mode == "llama.cpp":
                    bodies = [llama_body(it, shuffled(it, salt + i), args.max_tokens) for i, it in enumerate(picked)]
                    row[mode] = run_level(servers["llama.cpp"][1], bodies, clients, args.request_timeout)
                else:
                    bodies = [ours_body(it, shuffled(it, salt + i), args.max_tokens, mode == "blend")
                              for i, it in enumerate(picked)]
                    row[mode] = run_level(url, bodies, clients, args.request_timeout)
                print(f"clients={clients} {mode}: {json.dumps(row[mode])}", file=sys.stderr, flush=True)
            levels.append(row)
        report["levels"] = levels
        report["goals"] = goals(report)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    print_report(report, args.out)
    if args.plot:
        plot(report, args.plot)
    return 0


def goals(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ratio = report["in_process_at_1_client"]["http_over_in_process"]
    out["http_within_5pct_of_in_process_at_1_client"] = {"ratio": ratio, "met": ratio <= 1.05}
    at8 = next((row for row in report["levels"] if row["clients"] == 8), None)
    if at8 is not None and "ttft_p50_s" in at8.get("blend", {}):
        blend = at8["blend"]["ttft_p50_s"]
        full = at8["full_prefill"].get("ttft_p50_s")
        out["blend_vs_full_prefill_at_8"] = {"speedup": round(full / blend, 3) if full else None,
                                             "met": bool(full and full / blend >= 2.5)}
        llama = at8.get("llama.cpp", {}).get("ttft_p50_s")
        if llama is not None:
            out["blend_vs_llama_cpp_at_8"] = {"speedup": round(llama / blend, 3), "met": llama > blend}
    out["zero_errors"] = all(row[m]["errors"] == 0 for row in report["levels"] for m in row if m != "clients")
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, style in (("blend", "o-"), ("full_prefill", "s--"), ("llama.cpp", "^:")):
        points = [(row["clients"], row[mode]["ttft_p50_s"]) for row in levels if "ttft_p50_s" in row.get(mode, {})]
        if points:
            ax.plot(*zip(*points), style, label={"blend": "cacheblend-rag serve (blending)",
                                                 "full_prefill": "same server, full prefill",
                                                 "llama.cpp": "llama.cpp server (llama-cpp-python)"}[mode])
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("client TTFT p50 (s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([row["clients"] for row in levels], [str(row["clients"]) for row in levels])
    ax.set_title(f"MuSiQue, {report['settings']['passages']} passages as documents, SmolLM2-135M\n{report['cpu']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
