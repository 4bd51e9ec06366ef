"""Answer-quality and fidelity metrics used by the benchmark harness.

Gold F1 follows CacheBlend's MuSiQue evaluation: the first line of the generated
answer, SQuAD normalisation, token-level F1, the best score over the gold aliases.

Fidelity compares a method with full prefill along full prefill's own greedy answer
(teacher forcing): the per-token KL(full || method) and whether both pick the same
top-1 token. It is far less noisy than F1 on a handful of questions, so it is the
number quality work steers by.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def first_line(text: str) -> str:
    """The answer proper: models often add an explanation after a line break."""
    return text.lstrip("\n").split("\n")[0].strip()


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    """Token-level F1 of two strings after :func:`normalize_answer`.

    Two answers that both normalise to nothing count as a match (SQuAD v2 convention).
    """
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def gold_f1(generated: str, golds: Iterable[str]) -> float:
    """CacheBlend's MuSiQue metric: F1 of the first line of ``generated``, best over ``golds``."""
    answer = first_line(generated)
    scores = [f1_score(answer, gold) for gold in golds]
    return max(scores) if scores else 0.0


def gold_exact_match(generated: str, golds: Iterable[str]) -> bool:
    """SQuAD exact match: the first line of ``generated`` normalises to one of ``golds``."""
    answer = normalize_answer(first_line(generated))
    return any(answer == normalize_answer(gold) for gold in golds)


def answer_in_text(golds: Iterable[str], text: str) -> bool:
    """Whether some gold answer, normalised as for F1, occurs in ``text`` as whole words: a question
    whose answer is not in its prompt measures nothing by F1 (a model can only guess)."""
    haystack = f" {normalize_answer(text)} "
    return any(needle and f" {needle} " in haystack for needle in (normalize_answer(g) for g in golds))


def bootstrap_interval(values: Sequence[float], *, resamples: int = 2000, confidence: float = 0.95,
                       seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``values`` (paired differences, one per question),
    over ``resamples`` resamples of the questions with replacement; seeded, so a rerun reproduces it.
    ``None`` for fewer than two values."""
    data = np.asarray(values, dtype=np.float64)
    if data.size < 2:
        return None
    if not 0.0 < confidence < 1.0 or resamples < 1:
        raise ValueError(f"confidence={confidence} must lie in (0, 1) and resamples={resamples} be >= 1")
    rng = np.random.default_rng(seed)
    return _central_interval(data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1), confidence)


def _central_interval(estimates: np.ndarray, confidence: float) -> tuple[float, float]:
    """The central ``confidence`` share of a bootstrap's estimates (a percentile interval)."""
    tail = 100 * (1.0 - confidence) / 2
    low, high = np.percentile(estimates, [tail, 100 - tail])
    return float(low), float(high)


def recovery_interval(kl: Sequence[float], full_reuse_kl: Sequence[float], *, resamples: int = 2000,
                      confidence: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of :func:`recovery` over questions: ``kl[i]`` and ``full_reuse_kl[i]`` are
    one question's, resampled together (a ratio of means, so each resample recomputes both means). ``None`` for
    fewer than two questions."""
    method, reuse = np.asarray(kl, dtype=np.float64), np.asarray(full_reuse_kl, dtype=np.float64)
    if method.shape != reuse.shape:
        raise ValueError(f"{method.size} KL values against {reuse.size} of full reuse; pair them by question")
    if method.size < 2:
        return None
    if not 0.0 < confidence < 1.0 or resamples < 1:
        raise ValueError(f"confidence={confidence} must lie in (0, 1) and resamples={resamples} be >= 1")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, method.size, size=(resamples, method.size))
    reuse_means = reuse[picks].mean(axis=1)
    # A resample whose full reuse is exact everywhere has no recovery; it is left out, as recovery() would.
    defined = reuse_means > 0
    if not defined.any():
        return None
    return _central_interval(1.0 - method[picks].mean(axis=1)[defined] / reuse_means[defined], confidence)


def answers_match(generated: str, reference: str) -> bool:
    """Exact match of two generated answers (their first lines, whitespace-trimmed)."""
    return first_line(generated) == first_line(reference)


def token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(reference || other) in nats; both are ``[positions, vocab]`` logits."""
    if reference_logits.shape != logits.shape:
        raise ValueError(
            f"logits shapes differ: reference {tuple(reference_logits.shape)} vs {tuple(logits.shape)}; "
            "teacher-force both along the same tokens"
        )
    ref = F.log_softmax(reference_logits.float(), dim=-1)
    other = F.log_softmax(logits.float(), dim=-1)
    # Clamped at 0: identical distributions can come out at -1e-9 in float arithmetic.
    return (ref.exp() * (ref - other)).sum(dim=-1).clamp(min=0.0)


def top1_agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Share of positions where both logits pick the same most likely token."""
    return float((reference_logits.argmax(dim=-1) == logits.argmax(dim=-1)).float().mean())


def recovery(kl: float | None, full_reuse_kl: float | None) -> float | None:
    """``1 - KL(method) / KL(full reuse)``: 0 for full reuse, 1 for an exact method.

    ``None`` when it is undefined (no full-reuse reference, or full reuse is already exact).
    """
    if kl is None or full_reuse_kl is None or full_reuse_kl <= 0.0:
        return None
    return 1.0 - kl / full_reuse_kl


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """Median, 90th percentile and mean of ``values`` (``None`` for an empty list)."""
    if len(values) == 0:
        return {"median": None, "p90": None, "mean": None}
    data = np.asarray(values, dtype=np.float64)
    return {
        "median": float(np.median(data)),
        "p90": float(np.percentile(data, 90)),
        "mean": float(data.mean()),
    }


def mean_or_none(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None
