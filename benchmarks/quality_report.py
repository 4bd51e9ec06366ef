"""The strategy grid of a saved benchmark run: a markdown table and a recovery-by-ratio plot.

    python benchmarks/quality_report.py results/quality.json --plot docs/quality_recovery.png
"""

from __future__ import annotations

import argparse
import json

from cacheblend_rag.bench.plot import plot_recovery_by_ratio
from cacheblend_rag.bench.report import describe_run, strategy_grid_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="JSON written by `cacheblend-rag bench --out`")
    parser.add_argument("--plot", help="write the recovery-by-ratio PNG here")
    args = parser.parse_args(argv)
    with open(args.result, encoding="utf-8") as f:
        document = json.load(f)
    print(describe_run(document) + "\n")
    print(strategy_grid_table(document))
    if args.plot:
        print(f"\nplot written to {plot_recovery_by_ratio(document, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
