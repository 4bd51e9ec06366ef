"""``cacheblend-rag bench``: the MuSiQue benchmark from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cacheblend_rag.bench.config import DEFAULT_METHODS, BenchConfig
from cacheblend_rag.bench.references import DEFAULT_REFERENCE_DIR
from cacheblend_rag.engine.selection import available_strategies
from cacheblend_rag.errors import CacheBlendError, ConfigError
from cacheblend_rag.store.format.codec import STORAGE_DTYPES


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark TTFT, throughput and quality on MuSiQue against full prefill, prefix caching and full reuse",
        description=__doc__ + "\n\nWrites a JSON result (docs/benchmark_schema.md), prints a markdown table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_command)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument("--data", required=True,
                      help="MuSiQue-format JSON: a list of {question, answers, ctxs: [{title, text}]}")
    data.add_argument("--n", type=int, default=None, help="use the first N questions (default: all)")
    data.add_argument("--passages", type=int, default=10, help="passages per question, each one cached chunk")
    data.add_argument("--max-passage-tokens", type=int, default=None,
                      help="truncate each passage's text to this many tokens")
    data.add_argument("--answerable", action="store_true",
                      help="keep only questions whose gold answer (SQuAD-normalised) occurs in the passages after "
                           "truncation; says how many it kept. F1 on the others measures guessing")

    methods = parser.add_argument_group("methods")
    methods.add_argument(
        "--methods", default=DEFAULT_METHODS,
        help="comma-separated: full_prefill, prefix_caching, full_reuse, cacheblend, any selection strategy "
             f"({', '.join(available_strategies())}), 'default' (the engine's setting for the model: calibrated "
             "or built in), or 'all'; add '+prefix' for chunks precomputed "
             "behind the prompt text before the passages, '@RATIO' to pin one ratio, ':STORAGE' to store that method's chunk KV with another codec (int8, int4, ...)",
    )
    methods.add_argument("--ratios", default="0.05,0.15,0.3", help="recompute ratios for every blend method")
    methods.add_argument("--prefix-conditioned", choices=("off", "on", "both"), default="off",
                         help="run chunk-reusing methods as written (off), all prefix-conditioned (on), or both ways")
    methods.add_argument("--check-layer", type=int, default=None, help="override BlendConfig.check_layer")
    methods.add_argument("--blend-option", action="append", default=[], metavar="FIELD=VALUE",
                         help="set another BlendConfig field for every method, e.g. sink_tokens=8 (repeatable)")

    model = parser.add_argument_group("model and store")
    model.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    model.add_argument("--store", type=parse_store, default="memory", metavar="{memory,disk,disk:PATH}",
                       help="where chunk KV lives: a fresh store per question in memory or on disk, or "
                            "disk:PATH, one persistent disk store that later runs reuse (a rerun computes no chunk)")
    model.add_argument("--store-dir", default=None, help="parent directory for --store disk (default: the temp dir)")
    model.add_argument("--storage-dtype", choices=STORAGE_DTYPES, default="auto",
                       help="dtype chunk KV is stored in ('auto': 16-bit, the store's default)")

    timing = parser.add_argument_group("measurement")
    timing.add_argument("--max-new-tokens", type=int, default=32, help="tokens decoded per answer")
    timing.add_argument("--teacher-tokens", type=int, default=16,
                        help="tokens of full prefill's answer to teacher-force")
    timing.add_argument("--repeats", type=int, default=1,
                        help="warm TTFT runs per method and question (median taken)")
    timing.add_argument("--cold-examples", type=int, default=1, help="questions that also get a cold pass (empty store)")
    timing.add_argument("--throughput-requests", type=int, default=4,
                        help="requests (one per question, the first N) timed for throughput; 0 skips it")
    timing.add_argument("--throughput-new-tokens", type=int, default=32, help="tokens decoded per throughput request")

    loop = parser.add_argument_group("research loop (research/quality_notebook.md, \"Research loop\")")
    loop.add_argument("--reference-cache", nargs="?", const=str(DEFAULT_REFERENCE_DIR), default=None, metavar="DIR",
                      help="keep full prefill's references (greedy answer, teacher-forced logits) in DIR and reuse "
                           f"them: a cached reference skips full prefill, whose TTFT is then not measured "
                           f"(without DIR: {DEFAULT_REFERENCE_DIR})")
    loop.add_argument("--reference-kv", action="store_true",
                      help="also keep full prefill's prompt K/V in the reference cache (--diagnostics does)")
    loop.add_argument("--time-full-prefill", action="store_true",
                      help="with a cached reference, still time full prefill's TTFT (one prefill per repeat)")
    loop.add_argument("--diagnostics", action="store_true",
                      help="per question and method: KL by answer position, K/V distance to full prefill per "
                           "layer, the question's attention on stale entries")
    loop.add_argument("--resume", action="store_true",
                      help="read --out, keep its finished (question, method) pairs if its settings match, run "
                           "only the missing ones; the old file is copied to --out.<time>.bak first")

    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None, help="write the JSON result here (rewritten after every method)")
    output.add_argument("--plot", default=None, help="write a PNG of TTFT speedup against KL here")
    output.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        data=args.data, n=args.n, passages=args.passages, max_passage_tokens=args.max_passage_tokens,
        answerable=args.answerable,
        ratios=args.ratios, methods=args.methods, prefix_conditioned=args.prefix_conditioned,
        store=args.store[0], store_path=args.store[1], store_dir=args.store_dir, storage_dtype=args.storage_dtype,
        max_new_tokens=args.max_new_tokens, teacher_tokens=args.teacher_tokens, repeats=args.repeats,
        cold_examples=args.cold_examples, throughput_requests=args.throughput_requests,
        throughput_new_tokens=args.throughput_new_tokens, check_layer=args.check_layer,
        blend_options=parse_blend_options(args.blend_option),
        model=args.model, device=args.device, show_progress=not args.no_progress,
        reference_cache=args.reference_cache, reference_kv=args.reference_kv,
        time_full_prefill=args.time_full_prefill, diagnostics=args.diagnostics,
    )


def parse_store(text: str) -> tuple[str, str | None]:
    """``memory``, ``disk`` or ``disk:PATH`` -> (kind, persistent path or None)."""
    kind, sep, path = text.partition(":")
    if kind not in ("memory", "disk") or (sep and (kind != "disk" or not path)):
        raise argparse.ArgumentTypeError(f"{text!r}: choose memory, disk or disk:PATH")
    return kind, path or None


def parse_blend_options(items: list[str]) -> dict[str, Any]:
    """``["sink_tokens=8", "mask=bottom_right"]`` -> typed values (JSON literals, else strings)."""
    options: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--blend-option {item!r}: write FIELD=VALUE, e.g. --blend-option sink_tokens=8")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        options[name.strip()] = value
    return options


def run_command(args: argparse.Namespace) -> int:
    from cacheblend_rag.bench.harness import run_benchmark
    from cacheblend_rag.bench.plot import plot_speedup_vs_kl
    from cacheblend_rag.bench.report import answer_table, describe_run, markdown_table, write_json

    from cacheblend_rag.bench.resume import backup, load_result

    backed_up = False

    def checkpoint(document: dict[str, Any]) -> None:
        # After every method: a run stopped midway keeps the pairs it finished. The file it replaces
        # (an earlier run, or the one being resumed) is copied aside first, once.
        nonlocal backed_up
        if not backed_up:
            copy = backup(args.out)
            if copy is not None:
                print(f"cacheblend-rag bench: {args.out} copied to {copy} before it is rewritten", file=sys.stderr)
            backed_up = True
        write_json(document, args.out)

    try:
        if args.resume and not args.out:
            raise ConfigError("--resume reads and rewrites --out; pass --out")
        previous = load_result(args.out) if args.resume else None
        if args.resume and previous is None:
            print(f"cacheblend-rag bench: --resume: {args.out} does not exist yet; starting afresh", file=sys.stderr)
        document = run_benchmark(config_from_args(args), on_partial=checkpoint if args.out else None,
                                 resume=previous)
    except CacheBlendError as exc:  # bad options or data: say what is wrong, no traceback
        print(f"cacheblend-rag bench: error: {exc}", file=sys.stderr)
        return 2
    print(describe_run(document))
    print()
    print(markdown_table(document))
    print()
    print(answer_table(document))
    if args.out:
        checkpoint(document)
        print(f"\nJSON written to {args.out}", file=sys.stderr)
    if args.plot:
        print(f"plot written to {plot_speedup_vs_kl(document, args.plot)}", file=sys.stderr)
    return 0
