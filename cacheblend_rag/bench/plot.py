"""The speed/quality picture: TTFT speedup over full prefill against mean teacher-forced KL."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def plot_speedup_vs_kl(document: dict[str, Any], path: str | Path) -> Path:
    """Write a PNG with one labelled point per method (and ratio); a family's ratios are joined by a line."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    points = [m for m in document["methods"] if m["ttft_speedup"] is not None and m["quality"]["kl"] is not None]
    families: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for m in points:
        families[m["family"]].append(m)

    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=120)
    colors = plt.get_cmap("tab20")
    for i, (family, members) in enumerate(families.items()):
        members.sort(key=lambda m: m["ratio"] or 0.0)
        xs = [m["ttft_speedup"] for m in members]
        ys = [m["quality"]["kl"] for m in members]
        marker = "^" if members[0]["prefix_conditioned"] else "o"
        ax.plot(xs, ys, marker=marker, linestyle="-" if len(members) > 1 else "none",
                color=colors(i % 20), label=family, markersize=7)
        for m, x, y in zip(members, xs, ys):
            # The legend names the family; a blend's point only needs its ratio.
            label = f"@{m['ratio']:g}" if m["kind"] == "blend" else m["name"]
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7, color=colors(i % 20))
    return _finish(fig, ax, document, path, xlabel="TTFT speedup over full prefill (warm store, median)",
                   ylabel="mean teacher-forced KL(full prefill || method), nats",
                   legend_title="method (△ prefix-conditioned)")


def _finish(fig: Any, ax: Any, document: dict[str, Any], path: str | Path, *, xlabel: str, ylabel: str,
            legend_title: str) -> Path:
    """Labels, title, grid and a legend beside the axes; then write the PNG."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(_title(document), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), title=legend_title, title_fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _title(document: dict[str, Any]) -> str:
    d = document["data"]
    return (
        f"{document['model']['name']} on {d['examples']} MuSiQue questions, {d['passages']} passages"
        + (f" (<= {d['max_passage_tokens']} tokens each)" if d["max_passage_tokens"] else "")
        + f"; store: {document['store']['kind']}"
    )


def plot_recovery_by_ratio(document: dict[str, Any], path: str | Path) -> Path:
    """Write a PNG of recovery against recompute ratio: one line per selection strategy, solid when
    chunks were prefix-conditioned, dashed when not; full reuse's recovery as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blends: dict[str, list[dict[str, Any]]] = defaultdict(list)
    reuse = []
    for m in document["methods"]:
        if m["quality"]["recovery"] is None:
            continue
        if m["kind"] == "blend":
            blends[m["family"]].append(m)
        elif m["kind"] == "full_reuse":
            reuse.append(m)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    colors = plt.get_cmap("tab10")
    strategies = sorted({m["selection"] for members in blends.values() for m in members})
    for family, members in sorted(blends.items()):
        members.sort(key=lambda m: m["ratio"])
        color = colors(strategies.index(members[0]["selection"]) % 10)
        prefixed = members[0]["prefix_conditioned"]
        ax.plot([m["ratio"] for m in members], [100 * m["quality"]["recovery"] for m in members],
                marker="^" if prefixed else "o", linestyle="-" if prefixed else "--", color=color, label=family)
    for m in reuse:
        ax.axhline(100 * m["quality"]["recovery"], color="grey", linestyle="-" if m["prefix_conditioned"] else "--",
                   linewidth=0.8)
        ax.annotate(m["family"], (0, 100 * m["quality"]["recovery"]), textcoords="offset points", xytext=(2, 3),
                    fontsize=7, color="grey", xycoords=("axes fraction", "data"))
    return _finish(fig, ax, document, path, xlabel="recompute ratio (share of cached tokens recomputed)",
                   ylabel="recovery: 1 - KL(method) / KL(full reuse), %", legend_title="solid: prefix-conditioned")


# Ten distinct colours, then the same colours dashed: lines of similar methods must not hide each other.
_STYLES = ("-", "--", ":")


def _diagnosed(document: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each method's diagnostics over the questions that have them, in the document's method order."""
    out: dict[str, list[dict[str, Any]]] = {m["name"]: [] for m in document["methods"]}
    for example in document["examples"]:
        for name, outcome in example["methods"].items():
            if outcome.get("diagnostics") and name in out:
                out[name].append(outcome["diagnostics"])
    return {name: found for name, found in out.items() if found}


def _mean_by_index(series: list[list[float | None]]) -> list[float | None]:
    """Element-wise mean over lists of different lengths, ignoring ``None`` (a layer with no such token)."""
    longest = max((len(s) for s in series), default=0)
    means: list[float | None] = []
    for i in range(longest):
        kept = [s[i] for s in series if i < len(s) and s[i] is not None]
        means.append(sum(kept) / len(kept) if kept else None)
    return means


def plot_stale_kv_distance(document: dict[str, Any], path: str | Path) -> Path:
    """Write a PNG of the stale tokens' K and V distance to full prefill and the question's attention
    on stale entries, per layer, one line per chunk-reusing method (means over questions; the
    definitions are in :mod:`cacheblend_rag.bench.diagnostics`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diagnosed = {name: ds for name, ds in _diagnosed(document).items() if any("kv_distance" in d for d in ds)}
    if not diagnosed:
        raise ValueError("no K/V diagnostics in this result; run `cacheblend-rag bench --diagnostics`")
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), dpi=120)
    colors = plt.get_cmap("tab10")
    panels = [("K", lambda d: d["kv_distance"]["stale"]["k"]), ("V", lambda d: d["kv_distance"]["stale"]["v"]),
              ("attention", lambda d: d["attention_share"]["stale"])]
    for i, (name, found) in enumerate(diagnosed.items()):
        for ax, (_, pick) in zip(axes, panels):
            means = _mean_by_index([pick(d) for d in found if "kv_distance" in d])
            layers = [layer for layer, v in enumerate(means) if v is not None]
            ax.plot(layers, [means[layer] for layer in layers], marker=".", color=colors(i % 10),
                    linestyle=_STYLES[(i // 10) % len(_STYLES)], label=name)
    axes[0].set_ylabel("stale tokens: mean ||K_blend - K_full|| / ||K_full||")
    axes[1].set_ylabel("stale tokens: mean ||V_blend - V_full|| / ||V_full||")
    axes[2].set_ylabel("share of the question's attention on stale entries")
    for ax in axes:
        ax.set_xlabel("layer")
        ax.grid(True, alpha=0.3)
    fig.suptitle(_title(document) + f"; means over {max(len(v) for v in diagnosed.values())} questions", fontsize=9)
    axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), title="method", title_fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_kl_by_position(document: dict[str, Any], path: str | Path) -> Path:
    """Write a PNG of the teacher-forced KL at each answer position, one line per method (means over
    the questions whose answer reaches that position)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diagnosed = _diagnosed(document)
    if not diagnosed:
        raise ValueError("no diagnostics in this result; run `cacheblend-rag bench --diagnostics`")
    fig, ax = plt.subplots(figsize=(10, 6), dpi=120)
    colors = plt.get_cmap("tab10")
    for i, (name, found) in enumerate(diagnosed.items()):
        means = _mean_by_index([d["kl_by_position"] for d in found])
        ax.plot(range(len(means)), means, marker=".", color=colors(i % 10),
                linestyle=_STYLES[(i // 10) % len(_STYLES)], label=name)
    ax.set_yscale("symlog", linthresh=1e-4)
    return _finish(fig, ax, document, path, xlabel="answer position (teacher-forced token)",
                   ylabel="mean KL(full prefill || method), nats", legend_title="method")
