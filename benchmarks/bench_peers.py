"""Against what a user would run instead: TTFT, the share of the prompt reused and fidelity to this package's
float32 full prefill, for each peer on the same MuSiQue prompts (prints JSON; issue 55).

The prompts are the harness's (``cacheblend_rag.bench.prompt``: the model's chat template, ``--passages``
passages of up to ``--max-passage-tokens`` tokens, the question). The peers
(``bench_support.peers``, each set up as its own docs recommend for RAG):

- ``hf-fp32``, ``hf-bf16``: Hugging Face full prefill, the model's own forward (TTFT) and ``generate`` (answer);
- ``hf-prefix-fp32``, ``hf-prefix-bf16``: HF prefix caching, a DynamicCache of the lead every prompt shares;
- ``kvboost-cacheblend``, ``kvboost-selective``, ``kvboost-none``: KVBoost 0.9.0's chunk reuse, passages warmed;
- ``llama-cpp``, ``llama-cpp-cache``: llama.cpp (llama-cpp-python) on the GGUF this package's loader converts,
  full prefill and its prompt cache (``LlamaRAMCache``);
- ``cbr-default``, ``cbr-cacheblend@0.15``, ``cbr-full-reuse`` (float32) and ``cbr-default-bf16``,
  ``cbr-cacheblend@0.15-bf16``: this package, chunk KV warmed in memory.

Per prompt, every peer is prepared (untimed: passages warmed, caches filled) and run once as a warm-up;
then the peers take turns ``--repeats`` times (each round starting one peer later), and each reports the
median. TTFT runs from the request (token ids, or the rendered text where the peer takes text) to the first
greedy token. Fidelity: the first-token KL against float32 full prefill where the peer gives logits, and
whether its greedy answer of ``--max-new-tokens`` tokens is float32 full prefill's. A peer whose package is
missing is reported as skipped with the install hint (``make peers``); one that fails, with its error.

    .venv/bin/python benchmarks/bench_peers.py --n 6 --repeats 3 --out results/peers_smollm2.json \\
        --plot docs/peers_smollm2.png
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench_engine import DEFAULT_DATA, git_commit
from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.bench.report import print_report
from cacheblend_rag.bench.metrics import token_kl
from bench_support.peers import LLAMA_FORMATS, PEERS, Peer, PeerContext, PeerUnavailable, requantized_gguf
from cacheblend_rag.bench.prompt import BenchPrompt, build_prompt, load_musique
from cacheblend_rag.bench.requests import FullPrefillRequest, run_request
from cacheblend_rag.engine.generate import eos_token_ids

logger = logging.getLogger("bench_peers")
BASELINES = ("hf-fp32", "hf-bf16")  # speedups are stated against each that ran


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="catalog name, model folder, .gguf or hub id (default: SmolLM2)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF llama.cpp reads (default: the one the loader converts for --model, if any)")
    p.add_argument("--llama-format", choices=sorted(LLAMA_FORMATS), default=None,
                   help="llama.cpp reads the GGUF re-quantized to this type by its own llama_model_quantize (cached "
                        "beside the loader's files): its faster CPU formats from the same weights (default: as is)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--n", type=int, default=6, help="questions (the first N of --data)")
    p.add_argument("--passages", type=int, default=10)
    p.add_argument("--max-passage-tokens", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=16, help="length of the greedy answers compared")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", default="all", help=f"comma-separated, of: {', '.join(PEERS)} (default: all)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--plot", type=Path, default=None, help="also draw median TTFT per peer as a PNG here")
    args = p.parse_args(argv)
    if min(args.n, args.passages, args.repeats, args.max_new_tokens) < 1:
        p.error("--n, --passages, --repeats and --max-new-tokens must be at least 1")
    names = list(PEERS) if args.peers == "all" else [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        p.error(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    args.peer_names = names
    return args


def default_gguf(model: str | None) -> Path | None:
    """The GGUF the loader converts for ``model``: the embedded SmolLM2's, a catalog model's, a .gguf path."""
    from cacheblend_rag.models import catalog
    from cacheblend_rag.models.loader import cache_root, default_gguf_path

    if model is None:
        return default_gguf_path()
    known = catalog.lookup(model)
    if known is not None:
        return catalog.installed_gguf(known, cache_root())
    return Path(model) if model.endswith(".gguf") else None


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
        if names:
            return names[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        flags = set()
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "bf16_flags": sorted(flags & {"amx_bf16", "avx512_bf16"}), "platform": platform.platform()}


def versions() -> dict[str, str | None]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__, **{
        d: version(d) for d in ("transformers", "cacheblend-rag", "kvboost", "llama-cpp-python")}}


class Runner:
    """Starts the peers, runs them prompt by prompt, and keeps what each reported or why it did not run."""

    def __init__(self, names: list[str], ctx: PeerContext) -> None:
        self.peers: list[Peer] = []
        self.status: dict[str, dict[str, Any]] = {}
        for name in names:
            cls = PEERS[name]
            self.status[name] = {"setup": cls.setup, "docs": cls.docs}
            if cls.requires and importlib.util.find_spec(cls.requires) is None:
                self._drop(name, "skipped", f"{cls.requires} is not installed: {cls.install}")
                continue
            peer = cls(ctx)
            self.peers.append(peer)
            if self._guard(peer, peer.start):
                self.status[name].update(status="ok", **({"info": peer.info} if peer.info else {}))

    def _drop(self, name: str, status: str, reason: str) -> None:
        self.status[name].update(status=status, reason=reason)
        logger.warning("%s %s: %s", name, status, reason)

    def _guard(self, peer: Peer, call, *args):
        """``call(*args)``, or ``None`` with the peer marked skipped (PeerUnavailable) or failed (any error)."""
        try:
            result = call(*args)
            return True if result is None else result
        except PeerUnavailable as exc:
            self._drop(peer.name, "skipped", str(exc))
        except Exception as exc:  # a peer's failure is reported, and the others run on
            logger.debug("%s", traceback.format_exc())
            self._drop(peer.name, "failed", f"{type(exc).__name__}: {exc}")
        if peer in self.peers:
            self.peers.remove(peer)
        return None

    def run_prompt(self, prompt: BenchPrompt, repeats: int) -> dict[str, dict[str, Any]]:
        for peer in list(self.peers):
            if self._guard(peer, peer.prepare, prompt):
                self._guard(peer, peer.first_token, prompt)  # the warm-up
        runs: dict[str, list] = {p.name: [] for p in self.peers}
        for r in range(repeats):
            order = self.peers[r % len(self.peers):] + self.peers[: r % len(self.peers)] if self.peers else []
            for peer in order:
                if peer in self.peers and (timed := self._guard(peer, peer.first_token, prompt)):
                    runs[peer.name].append(timed)
        out = {}
        for peer in list(self.peers):
            answer = self._guard(peer, peer.answer, prompt)
            if answer:
                out[peer.name] = {"runs": runs[peer.name], "answer": answer}
        return out

    def close(self) -> None:
        for peer in self.peers:
            self._guard(peer, peer.close)


def reference(engine: CacheBlendEngine, prompt: BenchPrompt, max_new_tokens: int):
    """This package's float32 full prefill: the greedy answer and the first-token logits."""
    run = run_request(engine, FullPrefillRequest(engine, prompt.input_ids), max_new_tokens=max_new_tokens,
                      eos_ids=eos_token_ids(engine), teacher_limit=1)
    return run.text, run.teacher_logits[0]


def prompt_row(index: int, question: str, prompt: BenchPrompt, ref: tuple[str, torch.Tensor],
               results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ref_text, ref_logits = ref
    n = prompt.num_tokens
    peers = {}
    for name, result in results.items():
        times = [t.ttft_s for t in result["runs"]]
        answer = result["answer"]
        logits = answer.first_logits
        kl = None if logits is None else float(token_kl(ref_logits[None], logits.float()[None])[0])
        peers[name] = {
            "ttft_s": statistics.median(times), "runs_s": times,
            "reused_tokens": result["runs"][-1].reused_tokens,
            "reuse_share": result["runs"][-1].reused_tokens / n,
            "first_token_kl": kl,
            "first_token_match": None if logits is None else int(logits.argmax()) == int(ref_logits.argmax()),
            "answer": answer.text,
            "answer_match": None if answer.text is None else answer.text.strip() == ref_text.strip(),
            **answer.extra,
        }
    return {"index": index, "question": question, "prompt_tokens": n, "reference_answer": ref_text, "peers": peers}


def summarize(rows: list[dict[str, Any]], status: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    summary = {}
    for name, state in status.items():
        mine = [r["peers"][name] for r in rows if name in r["peers"]]
        entry = dict(state)
        if mine:
            kls = [m["first_token_kl"] for m in mine if m["first_token_kl"] is not None]
            matches = [m["answer_match"] for m in mine if m["answer_match"] is not None]
            entry.update(
                prompts=len(mine), ttft_s_median=statistics.median(m["ttft_s"] for m in mine),
                reuse_share_mean=statistics.fmean(m["reuse_share"] for m in mine),
                first_token_kl_median=statistics.median(kls) if kls else None,
                first_token_kl_mean=statistics.fmean(kls) if kls else None,
                answers_matching=f"{sum(matches)}/{len(matches)}" if matches else None)
            for base in BASELINES:  # the median over prompts of the baseline's TTFT over this peer's
                ratios = [r["peers"][base]["ttft_s"] / r["peers"][name]["ttft_s"] for r in rows
                          if base in r["peers"] and name in r["peers"]]
                if ratios:
                    entry[f"speedup_vs_{base}"] = statistics.median(ratios)
        summary[name] = entry
    return summary


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    ran = {n: s for n, s in report["peers"].items() if s.get("ttft_s_median") is not None}
    names = list(ran)[::-1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.8), dpi=120)
    ax.barh(names, [ran[n]["ttft_s_median"] for n in names],
            color=["tab:green" if n.startswith("cbr-") else "tab:gray" for n in names])
    for i, n in enumerate(names):
        s = ran[n]
        kl = "-" if s["first_token_kl_median"] is None else f"{s['first_token_kl_median']:.3g}"
        ax.annotate(f" {s['ttft_s_median']:.2f} s | reused {100 * s['reuse_share_mean']:.0f}% | KL {kl} | "
                    f"answers {s['answers_matching'] or '-'}", (s["ttft_s_median"], i), va="center", fontsize=7)
    ax.set_xlabel("median TTFT over prompts, s (each prompt: median of its repeats)")
    ax.set_xlim(right=1.9 * max(s["ttft_s_median"] for s in ran.values()))
    skipped = [n for n, s in report["peers"].items() if s.get("status") != "ok"]
    m = report["machine"]
    cpu = m["cpu"] + (f" ({', '.join(m['bf16_flags'])})" if m["bf16_flags"] else "")
    ax.set_title(f"{report['model']}, {report['prompt_tokens_median']:,} tokens (median), {cpu}, "
                 f"{m['torch_threads']} threads" + (f"\nnot run: {', '.join(skipped)}" if skipped else ""),
                 fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None, engine: CacheBlendEngine | None = None) -> int:
    """``engine``: a ready float32 engine (the tests pass a tiny one; llama.cpp then needs ``--gguf``)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("kvboost").setLevel(logging.ERROR)  # warm()'s per-passage notes: in the JSON instead
    args = parse_args(argv)
    injected = engine is not None
    if engine is None:
        engine = CacheBlendEngine.from_pretrained(args.model, dtype="float32")
    examples = load_musique(args.data, args.n)
    prompts = [build_prompt(engine.tokenizer, ex, passages=args.passages, max_passage_tokens=args.max_passage_tokens)
               for ex in examples]
    longest = max(p.num_tokens for p in prompts) + args.max_new_tokens
    if longest > engine.context_window:
        raise SystemExit(f"a prompt needs {longest} tokens with its answer, beyond the model's {engine.context_window}; "
                         "lower --passages or --max-passage-tokens")
    ctx = PeerContext(engine=engine, threads=torch.get_num_threads(), max_new_tokens=args.max_new_tokens,
                      n_ctx=-(-(longest + 16) // 256) * 256,
                      load=None if injected else (lambda dtype: CacheBlendEngine.from_pretrained(args.model, dtype=dtype)),
                      gguf=args.gguf or (None if injected else default_gguf(args.model)))
    if args.llama_format and ctx.gguf is not None and importlib.util.find_spec("llama_cpp") is not None:
        from cacheblend_rag.models.loader import cache_root

        ctx.gguf = requantized_gguf(ctx.gguf, args.llama_format, cache_root() / "peers")
    runner = Runner(args.peer_names, ctx)
    rows = []
    try:
        for i, (example, prompt) in enumerate(zip(examples, prompts)):
            logger.info("prompt %d/%d: %d tokens", i + 1, len(prompts), prompt.num_tokens)
            results = runner.run_prompt(prompt, args.repeats)
            rows.append(prompt_row(i, example.question, prompt, reference(engine, prompt, args.max_new_tokens), results))
    finally:
        runner.close()
    report = {
        "benchmark": "peers", "model": engine.model_name, "gguf": None if ctx.gguf is None else str(ctx.gguf),
        "llama_format": args.llama_format or "as the GGUF is",
        "reference": "this package's float32 full prefill (first-token logits, greedy answer)",
        "data": str(args.data), "questions": len(prompts), "passages": args.passages,
        "max_passage_tokens": args.max_passage_tokens, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "warm_up_runs": 1, "interleaved": True,
        "prompt_tokens_median": int(statistics.median(p.num_tokens for p in prompts)),
        "peers": summarize(rows, runner.status), "prompts": rows,
        "machine": machine(), "versions": versions(), "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print_report(report, args.out)
    if args.plot is not None:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
