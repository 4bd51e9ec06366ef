"""Plot a ``gpu_check`` report: TTFT speedup over full prefill per model shape and prompt length, each method
with its chunk KV in GPU memory, in the host-memory tier and in a disk store read every time.

    python benchmarks/gpu_plot.py docs/data/gpu_check_h200_run3.json docs/gpu_speed_h200.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

METHODS = ["full reuse", "CacheBlend@0.15", "default@0.15", "default@0.5"]
WHERE = [("", "GPU memory"), (" (resident)", "host-memory tier"), (" (disk)", "disk store, read every time")]


def plot_report(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    rows = [row for row in report["ttft"] if "error" not in row]
    if not rows:
        raise SystemExit("the report has no timed rows to plot")
    where = [(suffix, label) for suffix, label in WHERE if any(f"{METHODS[0]}{suffix}" in row for row in rows)]
    columns = min(3, len(rows))
    fig, axes = plt.subplots(math.ceil(len(rows) / columns), columns, figsize=(5.2 * columns, 3.6 * math.ceil(
        len(rows) / columns)), dpi=110, squeeze=False)
    width = 0.8 / len(where)
    colors = plt.get_cmap("tab10")
    for ax, row in zip(axes.flat, rows):
        for j, (suffix, label) in enumerate(where):
            speedups = [row["full prefill"] / row[f"{m}{suffix}"] if f"{m}{suffix}" in row else 0.0 for m in METHODS]
            xs = [i + (j - (len(where) - 1) / 2) * width for i in range(len(METHODS))]
            ax.bar(xs, speedups, width, label=label, color=colors(j))
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(METHODS)), METHODS, fontsize=8)
        model = row["model"].removeprefix("random ").split(" (")[0]
        ax.set_title(f"{model}, {row['tokens']:,} tokens (full prefill {row['full prefill'] * 1000:.0f} ms)",
                     fontsize=9)
        ax.set_ylabel("speedup over full prefill", fontsize=8)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"TTFT on {report['device']}, {report['dtype']}, {report['date']} (above the dashed line: faster "
                 "than full prefill)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="a JSON report written by gpu_check.py --out")
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    print(plot_report(json.loads(args.report.read_text()), args.png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
