"""Draws docs/overview.png, the README's picture: what each method computes for one RAG prompt.

    python docs/overview_figure.py

The TTFT figures are the medians of docs/performance.md, "MuSiQue: speed and fidelity" (SmolLM2-135M,
50 questions, 10 passages of up to 200 tokens, 2,127 prompt tokens on average, disk store, 2-core CPU,
2026-11-29); the recomputed slivers are illustrative (15% of each chunk's tokens), not a recorded choice.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COMPUTED, REUSED, RECOMPUTED = "#d9534f", "#9ecae1", "#08519c"
LEAD, CHUNK, QUESTION, N_CHUNKS = 49, 200, 49, 10  # tokens: system turn + header, each passage, the question
ROWS = [  # label, TTFT median (s), how the chunks are treated
    ("full prefill", "5.76 s", "computed"),
    ("prefix caching (vLLM, SGLang)", "5.16 s", "prefix"),
    ("CacheBlend @15%", "1.59 s", "blend"),
]


def main(out: Path = Path(__file__).with_name("overview.png")) -> None:  # noqa: B008 (a constant path)
    rng = np.random.default_rng(0)
    fig, ax = plt.subplots(figsize=(9, 2.9), dpi=120)
    width = LEAD + N_CHUNKS * CHUNK + QUESTION
    for row, (_label, ttft, kind) in enumerate(ROWS):
        y = len(ROWS) - 1 - row
        ax.barh(y, LEAD, left=0, color=COMPUTED if kind == "computed" else REUSED, edgecolor="white")
        for c in range(N_CHUNKS):
            left = LEAD + c * CHUNK
            ax.barh(y, CHUNK, left=left, color=REUSED if kind == "blend" else COMPUTED, edgecolor="white")
            if kind == "blend":  # the ~15% of each chunk's tokens whose KV deviates most, recomputed
                for t in rng.choice(CHUNK, size=int(0.15 * CHUNK), replace=False):
                    ax.barh(y, 1, left=left + t, color=RECOMPUTED, linewidth=0)
            if row == 0:
                ax.text(left + CHUNK / 2, len(ROWS) - 0.45, f"{c + 1}" if c else "chunk 1", ha="center", fontsize=7)
        ax.barh(y, QUESTION, left=width - QUESTION, color=COMPUTED, edgecolor="white")
        ax.text(width + 25, y, ttft, va="center", fontsize=10, fontweight="bold")
    ax.text(0, len(ROWS) - 0.25, "lead", fontsize=7)
    ax.text(width, len(ROWS) - 0.25, "question", ha="right", fontsize=7)
    ax.text(width + 25, len(ROWS) - 0.45, "TTFT", fontsize=8)
    ax.set_yticks(range(len(ROWS)), [r[0] for r in reversed(ROWS)], fontsize=9)
    ax.set_xlim(0, width + 190)
    ax.set_ylim(-0.6, len(ROWS) - 0.05)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[Patch(color=COMPUTED, label="prefilled at query time"),
                       Patch(color=REUSED, label="KV loaded from the chunk store (RoPE re-rotated)"),
                       Patch(color=RECOMPUTED, label="recomputed: restores cross-chunk attention")],
              loc="upper center", bbox_to_anchor=(0.45, -0.02), ncol=3, fontsize=8, frameon=False)
    ax.set_title("One RAG prompt of 10 retrieved passages, three ways (SmolLM2-135M, MuSiQue, 2-core CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
