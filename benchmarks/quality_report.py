"""The strategy grid of a saved benchmark run: a markdown table and a recovery-by-ratio plot; with
diagnostics (`cacheblend-rag bench --diagnostics`), their per-layer and per-position plots.

    python benchmarks/quality_report.py results/quality.json --plot docs/quality_recovery.png
    python benchmarks/quality_report.py results/diag.json --kv-plot results/diag_kv.png --kl-plot results/diag_kl.png
"""

from __future__ import annotations

import argparse
import json

from cacheblend_rag.bench.plot import plot_kl_by_position, plot_recovery_by_ratio, plot_stale_kv_distance
from cacheblend_rag.bench.report import describe_run, diagnostics_table, strategy_grid_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="JSON written by `cacheblend-rag bench --out`")
    parser.add_argument("--plot", help="write the recovery-by-ratio PNG here")
    parser.add_argument("--kv-plot", help="write the per-layer PNG of stale tokens' K/V distance to full prefill "
                                          "and the question's attention on them here (needs --diagnostics)")
    parser.add_argument("--kl-plot", help="write the KL-by-answer-position PNG here (needs --diagnostics)")
    args = parser.parse_args(argv)
    with open(args.result, encoding="utf-8") as f:
        document = json.load(f)
    print(describe_run(document) + "\n")
    print(strategy_grid_table(document))
    diagnostics = diagnostics_table(document)
    if diagnostics:
        print("\n" + diagnostics)
    if args.plot:
        print(f"\nplot written to {plot_recovery_by_ratio(document, args.plot)}")
    if args.kv_plot:
        print(f"K/V distance plot written to {plot_stale_kv_distance(document, args.kv_plot)}")
    if args.kl_plot:
        print(f"KL-by-position plot written to {plot_kl_by_position(document, args.kl_plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
