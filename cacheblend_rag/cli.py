"""The ``cacheblend-rag`` command. Each command group lives with the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules exposing ``register(subparsers)``; each adds its own sub-commands.
COMMAND_MODULES = ("cacheblend_rag.store_commands", "cacheblend_rag.bench.commands", "cacheblend_rag.models.commands",
                   "cacheblend_rag.calibration.commands", "cacheblend_rag.server.commands")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheblend-rag", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
