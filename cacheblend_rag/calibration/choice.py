"""What a calibration asks of a setting (:class:`CalibrationTarget`), what it measured of each
(:class:`CandidateOutcome`), and the choice (:func:`choose`); :mod:`cacheblend_rag.calibration.measure` runs
the measurements.

The target is on KL (recovery of full reuse's KL, prompts no worse than full reuse) and, when given, on
answers: top-1 agreement with full prefill along its answer under teacher forcing, and the share of
prompts whose greedy answer is full prefill's. KL alone can favour a setting whose mean is low while the
answers change: on 32 held-out MuSiQue questions at 300-token passages (Qwen2.5-1.5B), the shipped
setting recovered 69% of full reuse's KL and still changed a third of the answers (issue 58). A higher
ratio keeps more of them, and where it is cheap (a GPU) the answers are the better yardstick.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from cacheblend_rag.errors import ConfigError

# Slack on the answer targets: a mean of per-prompt shares (15/16 + ...) may land a rounding error below the
# share the user wrote, which is no shortfall.
_ROUNDING = 1e-9


def _share(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and \
        0.0 <= value <= 1.0


@dataclass(frozen=True)
class CalibrationTarget:
    """recovery: the least recovery of full reuse's KL a setting must reach (0.8: 80%);
    allow_worse: how many prompts may be worse than full reuse; max_cost: the most a setting may cost
    (full prefill = 1; with measured TTFT as the cost, 1 / 3.5 keeps a 3.5x floor), or None for no
    ceiling. A setting above the ceiling is not chosen, not even as the best measured one when the
    target is out of reach; only when every candidate is above it is the cheapest used, and said.

    Targets on answers, each None (not asked) or a share in [0, 1]: min_top1, the least mean top-1
    agreement with full prefill along its answer, teacher-forced (0.9: nine tokens in ten are the token
    full prefill ranks first); min_identical_answers, the least share of prompts whose greedy answer is full
    prefill's, token for token over the measured answer tokens (0.6: three prompts in five)."""

    recovery: float = 0.8
    allow_worse: int = 0
    max_cost: float | None = None
    min_top1: float | None = None
    min_identical_answers: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.recovery, bool) or not isinstance(self.recovery, (int, float)) or \
                not math.isfinite(self.recovery):
            raise ConfigError(f"target recovery={self.recovery!r} must be a number such as 0.8 (80% of full reuse's "
                              "KL recovered); 1.0 asks for full prefill's quality")
        if isinstance(self.allow_worse, bool) or not isinstance(self.allow_worse, int) or self.allow_worse < 0:
            raise ConfigError(f"allow_worse={self.allow_worse!r} must be an integer >= 0 (prompts allowed to be "
                              "worse than full reuse)")
        if self.max_cost is not None and (isinstance(self.max_cost, bool) or not isinstance(self.max_cost, (int, float))
                                          or not math.isfinite(self.max_cost) or self.max_cost <= 0):
            raise ConfigError(f"max_cost={self.max_cost!r} must be a number > 0, the most a setting may cost with full "
                              "prefill = 1 (with --cost ttft, 0.29 keeps a 3.5x speedup), or None for no ceiling")
        if self.min_top1 is not None and not _share(self.min_top1):
            raise ConfigError(f"min_top1={self.min_top1!r} (--min-top1) must be a share between 0 and 1, e.g. 0.9 "
                              "(nine answer tokens in ten ranked first as full prefill ranks them), or None for none")
        if self.min_identical_answers is not None and not _share(self.min_identical_answers):
            raise ConfigError(f"min_identical_answers={self.min_identical_answers!r} (--min-identical-answers) must "
                              "be a share between 0 and 1, e.g. 0.6 (three greedy answers in five the same as full "
                              "prefill's), or None for none")

    @property
    def on_answers(self) -> bool:
        """Whether a target on answers is given."""
        return self.min_top1 is not None or self.min_identical_answers is not None

    def describe(self, prompts: int) -> str:
        """What is asked, in words: ``recovery >= 0.8 with at most 0 of 8 prompts worse than full reuse,
        top-1 agreement >= 0.9, identical answers >= 0.6``."""
        parts = [f"recovery >= {self.recovery:g} with at most {self.allow_worse} of {prompts} prompts worse than "
                 "full reuse"]
        if self.min_top1 is not None:
            parts.append(f"top-1 agreement >= {self.min_top1:g}")
        if self.min_identical_answers is not None:
            parts.append(f"identical answers >= {self.min_identical_answers:g}")
        return ", ".join(parts)


@dataclass
class CandidateOutcome:
    """One candidate over every prompt."""

    name: str
    config: dict[str, Any]
    condition_chunks: bool
    kl: float  # mean over prompts
    recovery: float | None
    worse_than_full_reuse: int
    cost: float  # mean over prompts, full prefill = 1
    meets_target: bool
    per_prompt_kl: list[float] = field(default_factory=list)
    reference: bool = False  # full reuse, measured as the yardstick (not a candidate)
    top1: float = 0.0  # mean over prompts of the top-1 agreement with full prefill along its answer, teacher-forced
    identical_answers: float = 0.0  # the share of prompts whose greedy answer is full prefill's

    def table_row(self) -> str:
        rec = "–" if self.recovery is None else f"{self.recovery:.3f}"
        mark = "yes" if self.meets_target else ("(reference)" if self.reference else "no")
        return (f"| {self.name} | {self.kl:.4g} | {rec} | {self.worse_than_full_reuse} | {self.top1:.3f} | "
                f"{self.identical_answers:.2f} | {self.cost:.3f} | {mark} |")

    def summary(self, target: CalibrationTarget | None = None) -> str:
        """What it got on what ``target`` asks (``None``: everything): ``recovery 0.71, top-1 0.88, identical
        answers 0.50``."""
        recovered = "recovery " + ("–" if self.recovery is None else f"{self.recovery:.3f}")
        return ", ".join([recovered, *self.answer_parts(target)])

    def answer_parts(self, target: CalibrationTarget | None) -> list[str]:
        return ([f"top-1 {self.top1:.3f}"] if target is None or target.min_top1 is not None else []) + \
            ([f"identical answers {self.identical_answers:.2f}"]
             if target is None or target.min_identical_answers is not None else [])


def answers_met(row: CandidateOutcome, target: CalibrationTarget) -> bool:
    return (target.min_top1 is None or row.top1 >= target.min_top1 - _ROUNDING) and \
        (target.min_identical_answers is None or row.identical_answers >= target.min_identical_answers - _ROUNDING)


def choose(full_reuse: CandidateOutcome, rows: Sequence[CandidateOutcome], target: CalibrationTarget,
           prompts: int) -> tuple[list[CandidateOutcome], CandidateOutcome, bool, str]:
    """Mark the rows that meet ``target`` and choose: the rows ordered by cost, the chosen one (a row or
    ``full_reuse``), whether it meets the target, and the message that says why it was chosen."""

    def affordable(row: CandidateOutcome) -> bool:
        return target.max_cost is None or row.cost <= target.max_cost

    # Out of reach, the best measured is ranked on answers first when the user asked for answers (keeping them is
    # what the user said matters), then on KL.
    def answers_rank(row: CandidateOutcome) -> tuple[float, ...]:
        return ((-row.identical_answers,) if target.min_identical_answers is not None else ()) + \
            ((-row.top1,) if target.min_top1 is not None else ())

    exact_reuse = full_reuse.kl <= 0.0
    for row in rows:
        # Where full reuse is already exact, recovery is undefined: only "never worse" (exact too) counts.
        good = (row.recovery is not None and row.recovery >= target.recovery) or exact_reuse
        row.meets_target = good and row.worse_than_full_reuse <= target.allow_worse and affordable(row) and \
            answers_met(row, target)
    ordered = sorted(rows, key=lambda r: (r.cost, r.kl))
    meeting = [r for r in ordered if r.meets_target]
    within = [r for r in ordered if affordable(r)]
    want = target.describe(prompts)
    ceiling = "" if target.max_cost is None else f" at a cost of at most {target.max_cost:g}"
    widen = ("widen the grid (higher ratios), lower the target" + (" or raise the ceiling" if ceiling else ""))
    if meeting:
        chosen = meeting[0]
        return ordered, chosen, True, (f"target met ({want}{ceiling}): {chosen.name} is the cheapest setting that "
                                       f"meets it ({chosen.summary(target)})")
    if within:
        best = _best_of_each(within, target, ' within the cost ceiling' if ceiling else '')
        if (*answers_rank(full_reuse), full_reuse.kl) < min((*answers_rank(r), r.kl) for r in within):
            # Blending that moves the answer further than reusing the chunks as they are is worse than no blend.
            closest = min(within, key=lambda r: (*answers_rank(r), r.kl))
            return ordered, full_reuse, False, (
                f"target NOT reached: no candidate setting gives {want}{ceiling}, and every one"
                f"{' within the cost ceiling' if ceiling else ''} is further from full prefill than full reuse "
                f"(KL {full_reuse.kl:.4g}{''.join(', ' + a for a in full_reuse.answer_parts(target))}; "
                f"the closest candidate, {closest.name}, KL {closest.kl:.4g}). {best} Full reuse is used instead; "
                f"{widen}")
        # The target's "never worse than full reuse" is the user's floor on every prompt, so the settings that
        # hold it come first; among them (or among all, if none does) the lowest KL. A lower mean KL bought by
        # making a prompt worse is no better by the user's own measure, and on a handful of prompts the mean's
        # differences are mostly noise (research/quality_notebook.md, "The calibrated setting at 300-token
        # passages").
        safe = [r for r in within if r.worse_than_full_reuse <= target.allow_worse]
        chosen = min(safe or within, key=lambda r: (*answers_rank(r), r.kl, r.worse_than_full_reuse, r.cost))
        rule = ", then ".join((["most identical answers"] if target.min_identical_answers is not None else []) +
                              (["highest top-1"] if target.min_top1 is not None else []) + ["lowest KL"])
        how = (f"{rule} of those with at most {target.allow_worse} prompts worse than full reuse" if safe
               else f"{rule}; every one has more prompts worse than full reuse than the target allows")
        return ordered, chosen, False, (
            f"target NOT reached: no candidate setting gives {want}{ceiling}. {best} The best measured setting"
            f"{' within the cost ceiling' if ceiling else ''}, {chosen.name} ({how}: {chosen.summary(target)}), is "
            f"used instead; {widen}")
    chosen = min(ordered, key=lambda r: r.cost)
    return ordered, chosen, False, (
        f"target NOT reached: every candidate costs more than the ceiling ({target.max_cost:g}; the cheapest costs "
        f"{chosen.cost:.3f}). {chosen.name}, the cheapest, is used; raise --max-cost or add cheaper candidates")


def _best_of_each(rows: Sequence[CandidateOutcome], target: CalibrationTarget, where: str) -> str:
    """The best each asked-for measure reached, and by which setting: what the target was missed by."""
    parts = []
    with_recovery = [r for r in rows if r.recovery is not None]
    if with_recovery:
        top = max(with_recovery, key=lambda r: r.recovery or 0.0)
        parts.append(f"recovery {top.recovery:.3f} ({top.name})")
    fewest = min(rows, key=lambda r: r.worse_than_full_reuse)
    parts.append(f"{fewest.worse_than_full_reuse} prompts worse than full reuse ({fewest.name})")
    if target.min_top1 is not None:
        top = max(rows, key=lambda r: r.top1)
        parts.append(f"top-1 {top.top1:.3f} ({top.name})")
    if target.min_identical_answers is not None:
        top = max(rows, key=lambda r: r.identical_answers)
        parts.append(f"identical answers {top.identical_answers:.2f} ({top.name})")
    return f"Best measured{where}: " + "; ".join(parts) + "."
