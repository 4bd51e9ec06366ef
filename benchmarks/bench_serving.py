"""Serving throughput and latency with many clients: the scheduler's batched decoding against
requests served one at a time (prints JSON, writes a PNG).

MuSiQue questions rendered with the model's chat template (``--passages`` passages cut to
``--max-passage-tokens`` tokens: about 2,100 prompt tokens at the defaults), their passages
warmed into a disk store first, then answered with ``--max-new-tokens`` greedy tokens by:

* ``blend``: the default blend, through the engine's scheduler (what both integrations do);
* ``full_prefill``: no chunk KV reused, through the same scheduler;
* ``serial_blend``: the default blend as requests were served before the scheduler: one request
  at a time under a lock, decoded by the model's own forward over a ``DynamicCache``.

Two loads, the methods interleaved at each level: a closed loop of C clients (each sends its
next request when its answer is complete) for every C in ``--clients``, and an open loop of
requests arriving as a Poisson process at each rate of ``--rates`` (requests/s). Per run:
requests/s, output tokens/s, TTFT (to the first text a client receives) and end-to-end latency,
p50 and p95. ``--busy-check`` instead measures sync against async LangChain calls while two
other processes keep the cores busy.

    .venv/bin/python benchmarks/bench_serving.py --clients 1,2,4,8,16 --rates 0.2,0.4,0.8
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from cacheblend_rag import BlendConfig, GenerationConfig
from cacheblend_rag.bench.prompt import build_prompt, load_musique
from cacheblend_rag.engine.generate import TokenSampler, eos_token_ids
from cacheblend_rag.serving import BlendService, scheduler_for

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"
METHODS = ("blend", "full_prefill", "serial_blend")


class Methods:
    """The three ways of answering a rendered prompt; each returns (first-text time, end time, tokens)."""

    def __init__(self, service: BlendService, generation: GenerationConfig) -> None:
        self.service = service
        self.generation = generation
        self.blend = BlendConfig()
        self.lock = threading.Lock()

    def run(self, method: str, prompt: str) -> tuple[float, float, int]:
        if method == "serial_blend":
            return self._serial(prompt)
        started = time.perf_counter()
        first = None
        stream = self.service.stream(prompt, self.generation, self.blend, reuse=method == "blend")
        for _ in stream:
            first = first or time.perf_counter()
        served = stream.result()
        end = time.perf_counter()
        return (first or end) - started, end - started, served.result.completion_tokens

    def _serial(self, prompt: str) -> tuple[float, float, int]:
        """The serving path before the scheduler: the engine's lock held from blend to last token,
        the answer decoded by the model's forward (one token, one request per step)."""
        started = time.perf_counter()
        engine = self.service.engine
        with self.lock, torch.inference_mode():
            prepared = self.service.prepare(prompt, blend=self.blend)
            blended = engine.blend(prepared.segments, config=self.blend, store=self.service.chunk_cache)
            gen = self.generation.resolved(engine.model.generation_config)
            eos = eos_token_ids(engine)
            sampler = TokenSampler(gen, blended.input_ids, eos=eos)
            token, tokens, first = sampler(blended.logits), [], None
            cache: DynamicCache = blended.cache
            position = len(blended.input_ids)
            while token not in eos:
                tokens.append(token)
                first = first or time.perf_counter()  # text reaches the client from the first token on
                if len(tokens) >= gen.max_new_tokens:
                    break
                out = engine.model(input_ids=torch.tensor([[token]]), cache=cache,
                                   position_ids=torch.tensor([[position]]), use_cache=True)
                position += 1
                token = sampler(out.logits[0, -1], tokens)
        end = time.perf_counter()
        return (first or end) - started, end - started, len(tokens)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(records: list[tuple[float, float, int]], wall: float) -> dict[str, Any]:
    ttfts, ends, tokens = zip(*records)
    return {
        "requests": len(records), "wall_s": round(wall, 3),
        "requests_per_s": round(len(records) / wall, 4), "output_tokens_per_s": round(sum(tokens) / wall, 2),
        "ttft_p50_s": round(percentile(ttfts, 50), 3), "ttft_p95_s": round(percentile(ttfts, 95), 3),
        "latency_p50_s": round(percentile(ends, 50), 3), "latency_p95_s": round(percentile(ends, 95), 3),
        "mean_output_tokens": round(sum(tokens) / len(tokens), 1),
    }


def closed_loop(methods: Methods, method: str, prompts: list[str], clients: int, requests: int) -> dict[str, Any]:
    order = iter(range(requests))
    lock, records = threading.Lock(), []

    def client() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            record = methods.run(method, prompts[i % len(prompts)])
            with lock:
                records.append(record)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return summary(records, time.perf_counter() - started)


def open_loop(methods: Methods, method: str, prompts: list[str], rate: float, requests: int,
              seed: int) -> dict[str, Any]:
    arrivals, t = [], 0.0
    rng = random.Random(seed)  # the same arrival times for every method
    for _ in range(requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    records: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def request(i: int) -> None:
        record = methods.run(method, prompts[i % len(prompts)])
        with lock:
            records.append(record)

    threads = []
    for i, at in enumerate(arrivals):
        time.sleep(max(0.0, started + at - time.perf_counter()))
        thread = threading.Thread(target=request, args=(i,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return summary(records, time.perf_counter() - started)


def setup(args: argparse.Namespace) -> tuple[Methods, list[str], dict[str, Any]]:
    from llama_index.llms.cacheblend import CacheBlendLLM

    # The LlamaIndex LLM's own service: its chunk cache, conditioning prefix and defaults are the ones users get.
    llm = CacheBlendLLM(model=args.model or "SmolLM2-135M-Instruct", store_path=tempfile.mkdtemp(prefix="bench-kv-"))
    service, engine = llm.service, llm.engine
    examples = load_musique(args.data, args.questions)
    built = [build_prompt(engine.tokenizer, ex, passages=args.passages, max_passage_tokens=args.max_passage_tokens)
             for ex in examples]
    passages = [t for b in built for t in b.passage_texts]
    service.warm(passages, show_progress=True)
    service.chunk_cache.flush()
    service.announce(passages)
    min_new = args.max_new_tokens if args.min_new_tokens is None else args.min_new_tokens
    methods = Methods(service, GenerationConfig(max_new_tokens=args.max_new_tokens, min_new_tokens=min_new))
    for method in METHODS:  # warm-up: the correctness gate, first-call allocations
        methods.run(method, built[0].text)
    info = {"model": engine.model_name, "prompts": len(built),
            "mean_prompt_tokens": round(statistics.mean(b.num_tokens for b in built)),
            "passages": args.passages, "max_passage_tokens": args.max_passage_tokens,
            "max_new_tokens": args.max_new_tokens, "min_new_tokens": min_new, "store": "disk (warm)", "torch_threads": torch.get_num_threads(),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "python": sys.version.split()[0],
            "torch": torch.__version__}
    return methods, [b.text for b in built], info


def run_loads(args: argparse.Namespace, methods: Methods, prompts: list[str]) -> dict[str, list[dict[str, Any]]]:
    plan: list[tuple[str, str, float, Callable[[], dict[str, Any]]]] = []
    for clients in args.clients:
        for method in METHODS:
            requests = max(args.min_requests, args.requests_per_client * clients)
            plan.append(("closed", method, clients,
                         lambda m=method, c=clients, r=requests: closed_loop(methods, m, prompts, c, r)))
    for rate in args.rates:
        for method in METHODS:
            plan.append(("open", method, rate,
                         lambda m=method, r=rate: open_loop(methods, m, prompts, r, args.open_requests, args.seed)))
    results: dict[str, list[dict[str, Any]]] = {"closed_loop": [], "open_loop": []}
    for kind, method, level, run in tqdm(plan, desc="serving runs", unit="run"):
        result = {"method": method, ("clients" if kind == "closed" else "rate"): level, **run()}
        results["closed_loop" if kind == "closed" else "open_loop"].append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    return results


def ratios(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    by = {(r["method"], r["clients"]): r for r in results["closed_loop"]}
    out = {}
    for (method, clients), r in by.items():
        if method == "blend":
            full, serial = by.get(("full_prefill", clients)), by.get(("serial_blend", clients))
            out[f"clients={clients}"] = {
                "blend_vs_full_prefill_throughput": round(r["requests_per_s"] / full["requests_per_s"], 2) if full else None,
                "blend_vs_serial_throughput": round(r["requests_per_s"] / serial["requests_per_s"], 2) if serial else None,
                "blend_vs_serial_ttft_p50": round(r["ttft_p50_s"] / serial["ttft_p50_s"], 2) if serial else None,
            }
    return out


def plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    for method, color in zip(METHODS, ("tab:blue", "tab:orange", "tab:green")):
        rows = [r for r in document["open_loop"] if r["method"] == method]
        if rows:
            left.plot([r["rate"] for r in rows], [r["ttft_p50_s"] for r in rows], marker="o", color=color,
                      label=f"{method} p50")
            left.plot([r["rate"] for r in rows], [r["ttft_p95_s"] for r in rows], marker="x", linestyle="--",
                      color=color, label=f"{method} p95")
        rows = [r for r in document["closed_loop"] if r["method"] == method]
        right.plot([r["clients"] for r in rows], [r["requests_per_s"] for r in rows], marker="o", color=color,
                   label=method)
    left.set(xlabel="request rate (requests/s, Poisson arrivals)", ylabel="TTFT (s)", yscale="log",
             title="TTFT against request rate")
    right.set(xlabel="concurrent clients (closed loop)", ylabel="throughput (requests/s)", xscale="log",
              title="throughput against clients")
    right.set_xticks(document["settings"]["clients"], [str(c) for c in document["settings"]["clients"]])
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    info = document["setup"]
    fig.suptitle(f"{info['model']}, ~{info['mean_prompt_tokens']} prompt tokens, {info['max_new_tokens']} new tokens, "
                 f"{info['machine']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _spin() -> None:
    while True:
        pass


def busy_check(args: argparse.Namespace) -> dict[str, Any]:
    """Sync against async LangChain calls on 8 prompts while two other processes spin on both cores:
    one after another (``invoke`` from the main thread, ``await ainvoke``), and all at once
    (``batch``, ``asyncio.gather`` of ``ainvoke``)."""
    import asyncio
    import multiprocessing

    from langchain_cacheblend import ChatCacheBlend
    from langchain_core.messages import HumanMessage

    examples = load_musique(args.data, 8)
    chat = ChatCacheBlend(model=args.model or "SmolLM2-135M-Instruct", max_tokens=args.max_new_tokens,
                          store_path=tempfile.mkdtemp(prefix="bench-busy-kv-"))
    tokenizer = chat.get_engine().tokenizer
    built = [build_prompt(tokenizer, ex, passages=args.passages, max_passage_tokens=args.max_passage_tokens)
             for ex in examples]
    chat.warm([t for b in built for t in b.passage_texts], show_progress=True)
    messages = [[HumanMessage("Passages:\n" + "".join(b.passage_texts) + "Question: " + ex.question)]
                for b, ex in zip(built, examples)]
    chat.invoke(messages[0])  # warm-up

    async def one_by_one():
        return [await chat.ainvoke(m) for m in messages]

    async def gathered():
        return await asyncio.gather(*(chat.ainvoke(m) for m in messages))

    runs: dict[str, Callable[[], list[Any]]] = {
        "invoke_one_by_one": lambda: [chat.invoke(m) for m in messages],
        "ainvoke_one_by_one": lambda: asyncio.run(one_by_one()),
        "batch": lambda: chat.batch(messages),
        "gather_ainvoke": lambda: asyncio.run(gathered()),
    }
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(2)]
    for p in spinners:
        p.start()
    times: dict[str, list[float]] = {name: [] for name in runs}
    answers: dict[str, list[str]] = {}
    try:
        for _ in range(args.busy_repeats):  # interleaved
            for name, run in runs.items():
                started = time.perf_counter()
                answers[name] = [m.content for m in run()]
                times[name].append(round(time.perf_counter() - started, 2))
    finally:
        for p in spinners:
            p.kill()
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"busy_check": {"seconds": times, "median_s": med,
                           "sync_over_async_one_by_one": round(med["invoke_one_by_one"] / med["ainvoke_one_by_one"], 2),
                           "batch_over_gather": round(med["batch"] / med["gather_ainvoke"], 2),
                           "answers_equal": len({tuple(a) for a in answers.values()}) == 1,
                           "requests": len(messages), "max_new_tokens": args.max_new_tokens}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--passages", type=int, default=10)
    parser.add_argument("--max-passage-tokens", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--min-new-tokens", type=int, default=None,
                        help="end-of-sequence is not sampled before this many tokens (default: --max-new-tokens, so "
                        "every answer has the same length, as serving benchmarks fix it; 0: answers end at EOS)")
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--rates", default="0.2,0.4,0.8")
    parser.add_argument("--open-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy-check", action="store_true")
    parser.add_argument("--busy-repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/data/serving.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/serving_ttft_vs_rate.png"))
    args = parser.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",") if c]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    if not args.data.exists():
        raise SystemExit(f"{args.data} not found: pass --data with the MuSiQue dev file")
    if args.busy_check:
        document = busy_check(args)
        print(json.dumps(document, indent=2))
        return 0
    methods, prompts, info = setup(args)
    document: dict[str, Any] = {"setup": info, "settings": {"clients": args.clients, "rates": args.rates,
                                                           "open_requests": args.open_requests}}
    document.update(run_loads(args, methods, prompts))
    document["ratios"] = ratios(document)
    document["scheduler"] = scheduler_for(methods.service.engine).stats()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2))
    plot(document, args.plot)
    print(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
