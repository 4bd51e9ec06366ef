"""The speed-fidelity curve: each method's recovery of full reuse's KL (from harness runs) against its measured
TTFT speedup over full prefill (from ``bench_engine_scale.py`` runs), as a markdown table and a PNG.

Quality and speed come from different runs: the quality runs are long and run beside other work (their KL is
deterministic), the speed runs are short and need a quiet machine. Methods are matched by setting, with
``+prefix`` dropped (conditioning changes the chunks' values, not the work) and the speed bench's
``default@R`` read as ``query_profiled@R``. A method in several speed files takes the last file's speedup (each
speedup is a ratio within its own run, so runs on different days stay comparable).

    python research/speed_fidelity.py \\
        --quality research/data/quality_1p5b_t300.json research/data/quality_1p5b_t300_ratio03.json \\
        --speed research/data/engine_scale_ratio_1p5b.json research/data/engine_scale_default_probes_1p5b.json \\
        --plot research/figures/fidelity_t300_speed_1p5b.png \\
        --title "Qwen2.5-Coder-1.5B, 29 questions, 300-token passages"
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class Point:
    method: str  # the harness's setting, as --methods spells it
    recovery: float
    interval: tuple[float, float] | None
    worse: int
    questions: int
    speedup: float
    speed_file: str


def work_name(setting: str) -> str:
    """The name a method's work is known by in both kinds of run."""
    name = setting.replace("+prefix", "")
    return "query_profiled" + name[len("default"):] if name.startswith("default@") else name


def quality_rows(paths: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Setting -> the harness's row for it (later files win); baselines and partial runs' rows included."""
    rows: dict[str, dict[str, Any]] = {}
    for path in paths:
        document = json.loads(path.read_text())
        for method in document["methods"]:
            if method["kind"] in ("blend", "default") and method["quality"].get("recovery") is not None:
                rows[method.get("setting") or method["name"]] = {**method, "examples": len(document["examples"])}
    return rows


def speedups(paths: Sequence[Path]) -> dict[str, tuple[float, str]]:
    out: dict[str, tuple[float, str]] = {}
    for path in paths:
        for name, result in json.loads(path.read_text())["results"].items():
            if name != "full_prefill":
                out[work_name(name)] = (float(result["speedup"]), path.name)
    return out


def match(quality: Sequence[Path], speed: Sequence[Path]) -> tuple[list[Point], list[str]]:
    """The methods with both measurements, fastest first, and the quality rows that have no speed."""
    fast = speedups(speed)
    points, unmatched = [], []
    for setting, row in quality_rows(quality).items():
        found = fast.get(work_name(setting))
        if found is None:
            unmatched.append(setting)
            continue
        q = row["quality"]
        interval = tuple(q["recovery_ci95"]) if q.get("recovery_ci95") else None
        points.append(Point(setting, float(q["recovery"]), interval, int(q["worse_than_full_reuse"]),
                            int(row["examples"]), found[0], found[1]))
    points.sort(key=lambda p: -p.speedup)
    return points, unmatched


def table(points: Sequence[Point]) -> str:
    lines = ["| method | TTFT speedup | recovery [95%] | worse than full reuse | speed from |", "|---|---|---|---|---|"]
    for p in points:
        ci = f" [{p.interval[0]:.0%}, {p.interval[1]:.0%}]" if p.interval else ""
        lines.append(f"| {p.method} | {p.speedup:.2f}x | {p.recovery:.0%}{ci} | {p.worse}/{p.questions} | "
                     f"{p.speed_file} |")
    return "\n".join(lines)


def plot(points: Sequence[Point], path: Path, *, title: str = "", speed_line: float = 3.5,
         recovery_line: float = 0.7) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for p in points:
        color = "tab:green" if "probeshift" in p.method else "tab:blue" if "query_profiled" in p.method else "tab:gray"
        err = None if p.interval is None else [[(p.recovery - p.interval[0]) * 100], [(p.interval[1] - p.recovery) * 100]]
        ax.errorbar([p.speedup], [p.recovery * 100], yerr=err, fmt="o", color=color, capsize=3)
        ax.annotate(f"{p.method} ({p.worse} worse)", (p.speedup, p.recovery * 100), textcoords="offset points",
                    xytext=(6, 4), fontsize=7, color=color)
    ax.axvline(speed_line, color="tab:red", linestyle=":", linewidth=1)
    ax.axhline(recovery_line * 100, color="tab:red", linestyle=":", linewidth=1)
    ax.set_xlabel("TTFT speedup over full prefill (measured, median of the bench's runs)")
    ax.set_ylabel("recovery of full reuse's KL, % (bootstrap 95% interval)")
    ax.set_title(f"{title or 'Speed against fidelity'} (dotted: the targets)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quality", nargs="+", type=Path, required=True, help="`cacheblend-rag bench --out` JSONs")
    parser.add_argument("--speed", nargs="+", type=Path, required=True, help="bench_engine_scale.py --out JSONs")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument("--title", default="", help="the plot's title (the model and the prompts)")
    args = parser.parse_args(argv)
    points, unmatched = match(args.quality, args.speed)
    if not points:
        raise SystemExit("no method has both a quality row and a measured speedup; time the blends with "
                         "bench_engine_scale.py --methods (the harness's spelling)")
    print(table(points))
    if unmatched:
        print(f"\nno measured speed (run bench_engine_scale.py --methods ... for them): {', '.join(unmatched)}")
    if args.plot:
        print(f"\nwrote {plot(points, args.plot, title=args.title)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
