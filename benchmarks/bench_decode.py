"""Decoding's cost: operations per decoded token (per layer and in all), and tokens per second against
Hugging Face's ``generate`` on the same model and prompt (prints JSON).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_decode.py            # both, SmolLM2
    .venv/bin/python benchmarks/bench_decode.py --ops-only                   # counts only, seconds

Operations are counted as ``bench_dispatch.py`` counts a blend's (top-level ATen operations, torch's
profiler, on the CPU, where the count is what a GPU would launch), for one decoded token, split into the
step (:func:`~cacheblend_rag.engine.decode.decode_logits`), sampling (``Decoding.advance``) and taking
the token (``Decoding.accept``: stop strings, text), with the host syncs of the three (the token's id,
read back once, is the one a token cannot do without). Per layer is the difference between a model and
one twice as deep, over the layers added; the rest is the step's fixed part (embedding, rotary tables,
final norm and head). Beside them, one step of the model's own forward with its ``DynamicCache``, counted
alike. Shapes: the package's tiny test model, and SmolLM2-135M's and Qwen2.5-1.5B's layers and heads at a
narrow width (bench_dispatch's; widths change no count).

Speed: :func:`decode_speed` times ``engine.generate`` and the model's own ``generate``, greedy, a fixed
number of new tokens (``min_new_tokens = max_new_tokens``), taking turns so a busy machine slows both
alike; decode tokens/s is the tokens after the first over the time after the first (the first token is
the prefill's). Other scripts (the GPU check) can call it with their engine and prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dispatch import SHAPES  # noqa: E402
from bench_engine import DEFAULT_DATA, build_prompt, passages  # noqa: E402

from cacheblend_rag import CacheBlendEngine, CachedSegment, FreshSegment, GenerationConfig  # noqa: E402
from cacheblend_rag.bench.report import print_report  # noqa: E402
from bench_support.host_syncs import count_host_syncs  # noqa: E402
from cacheblend_rag.engine.decode import decode_logits  # noqa: E402
from cacheblend_rag.engine.generate import start_decoding  # noqa: E402
from cacheblend_rag.models.dtype_choice import cpu_model_name


# ------------------------------------------------------------------ operations per token
def _token_ops(engine: CacheBlendEngine, prompt: Sequence[int], warm: int = 3) -> dict[str, Any]:
    """Top-level ATen operations and host syncs of one decoded token, by part, after ``warm`` tokens."""
    gen = GenerationConfig(max_new_tokens=64, min_new_tokens=64)
    d = start_decoding(engine, [FreshSegment(list(prompt))], gen, None, None)
    d.accept()
    logits: list[torch.Tensor] = []
    parts: dict[str, Callable[[], Any]] = {
        "step": lambda: logits.append(decode_logits(engine, [d])[0]),
        "sample": lambda: d.advance(logits.pop()),
        "accept": d.accept,
    }
    for _ in range(warm):
        for run in parts.values():
            run()
    counts: dict[str, Any] = {name: _top_level_ops(run) for name, run in parts.items()}
    counts["host syncs"] = count_host_syncs(lambda: [run() for run in parts.values()]).by_site()
    return counts


def _top_level_ops(run: Callable[[], Any]) -> int:
    """``bench_dispatch.dispatched``'s count for one call, without its warm-up call (a decoding's parts
    must run in turn: a second step before sampling would feed the same token twice)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))


def decode_ops(arch: str, fields: dict[str, Any], prompt_tokens: int = 48) -> dict[str, Any]:
    """Operations per decoded token for ``fields``'s shape: per layer, fixed, and by part."""
    import gpu_check

    layers = fields["num_hidden_layers"]
    rows = []
    for depth in (layers, 2 * layers):
        engine = gpu_check.random_model(arch, {**fields, "num_hidden_layers": depth}, "ops", torch.device("cpu"),
                                        torch.float32, False)
        engine.tokenizer = _TokenIds()
        prompt = torch.randint(3, fields["vocab_size"] - 1, (prompt_tokens,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        rows.append({**_token_ops(engine, prompt), "hf step": _hf_step_ops(engine, prompt)})
    shallow, deep = rows
    per_layer = (deep["step"] - shallow["step"]) / layers
    return {"layers": layers, "per token": shallow["step"] + shallow["sample"] + shallow["accept"],
            "per layer": per_layer, "step fixed": shallow["step"] - per_layer * layers,
            "step": shallow["step"], "sample": shallow["sample"], "accept": shallow["accept"],
            "host syncs per token": shallow["host syncs"],
            "hf forward step": shallow["hf step"], "hf per layer": (deep["hf step"] - shallow["hf step"]) / layers}


@torch.inference_mode()
def _hf_step_ops(engine: CacheBlendEngine, prompt: Sequence[int]) -> int:
    """The same count for one step of the model's own forward with its ``DynamicCache`` (what ``generate``
    runs per token, less its logits processors and stopping checks)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=engine.model.config)
    ids = torch.tensor([list(prompt)])
    engine.model(input_ids=ids, cache=cache, use_cache=True)
    position = len(prompt)

    def step() -> None:
        nonlocal position
        engine.model(input_ids=ids[:, -1:], cache=cache, use_cache=True,
                     position_ids=torch.tensor([[position]]), logits_to_keep=1)
        position += 1

    step()
    return _top_level_ops(step)


class _TokenIds:
    """A stand-in tokenizer for random models: a token's text is its id and a space (no vocabulary to load)."""

    eos_token_id = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"{i} " for i in ids)

    def get_vocab(self) -> dict[str, int]:  # the model's fingerprint digests it
        return {}


def count_shapes() -> dict[str, Any]:
    from cacheblend_rag.testing import _TINY

    shapes = {"tiny": ("llama", {**_TINY, "vocab_size": 512, "head_dim": 16}), **SHAPES}
    return {name: decode_ops(arch, fields) for name, (arch, fields) in shapes.items()}


# ------------------------------------------------------------------ tokens per second
class _Clock:
    """A transformers streamer that notes when each token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def decode_speed(engine: CacheBlendEngine, segments: list[Any], ids: Sequence[int], new_tokens: int = 64,
                 rounds: int = 5) -> dict[str, Any]:
    """Decode tokens/s of ``engine.generate(segments)`` and of ``engine.model.generate(ids)``, greedy,
    exactly ``new_tokens`` each, taking turns ``rounds`` times after a warm-up of each; medians."""
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0)
    input_ids = torch.tensor([list(ids)], device=engine.device)
    mask = torch.ones_like(input_ids)

    def ours() -> float:
        result = engine.generate(segments, gen)
        assert len(result.token_ids) == new_tokens, result.finish_reason
        return (new_tokens - 1) / (result.total_s - result.ttft_s)

    def theirs() -> float:
        clock = _Clock()
        out = engine.model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None,
                                    top_k=None, streamer=clock, pad_token_id=engine.tokenizer.eos_token_id)
        _sync(engine.device)
        clock.times.append(time.perf_counter())
        assert out.shape[1] - input_ids.shape[1] == new_tokens
        # times: the prompt, each new token, the end; decoding runs from the first new token to the last.
        return (new_tokens - 1) / (clock.times[-2] - clock.times[1])

    ours(), theirs()
    runs: dict[str, list[float]] = {"engine": [], "hf_generate": []}
    for _ in range(rounds):
        runs["engine"].append(ours())
        runs["hf_generate"].append(theirs())
    engine_tps, hf_tps = statistics.median(runs["engine"]), statistics.median(runs["hf_generate"])
    return {"new_tokens": new_tokens, "prompt_tokens": len(ids), "engine_tokens_per_s": engine_tps,
            "hf_generate_tokens_per_s": hf_tps, "ratio": engine_tps / hf_tps, "runs": runs,
            "target_met": engine_tps >= hf_tps}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def smollm2_speed(chunks: int, chunk_tokens: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    engine = CacheBlendEngine.from_pretrained(None, dtype="float32")
    head, chunk_ids, tail = build_prompt(engine, passages(DEFAULT_DATA, chunks), chunks, chunk_tokens)
    segments = [FreshSegment(head), *map(CachedSegment, engine.prefill_chunks(chunk_ids)), FreshSegment(tail)]
    ids = head + [t for c in chunk_ids for t in c] + tail
    return {"model": engine.model_name, "dtype": str(engine.dtype), "threads": torch.get_num_threads(),
            **decode_speed(engine, segments, ids, new_tokens, rounds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops-only", action="store_true", help="count operations, skip the timing")
    parser.add_argument("--speed-only", action="store_true", help="time decoding, skip the counts")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"cpu": cpu_model_name(), "torch": torch.__version__}
    if not args.speed_only:
        report["ops per decoded token (top-level aten::)"] = count_shapes()
    if not args.ops_only:
        report["decode speed"] = smollm2_speed(args.chunks, args.chunk_tokens, args.new_tokens, args.rounds)
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
