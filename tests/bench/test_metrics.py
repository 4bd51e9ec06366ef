"""Metric checks on hand-made cases."""

from __future__ import annotations

import math

import pytest
import torch

from cacheblend_rag.bench.metrics import (
    answer_in_text,
    answers_match,
    bootstrap_interval,
    f1_score,
    first_line,
    gold_exact_match,
    gold_f1,
    normalize_answer,
    recovery,
    recovery_interval,
    summarize,
    token_kl,
    top1_agreement,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("an Apple, a day!", "apple day"),
        ("  Exeter   College. ", "exeter college"),
        ("Theater of the Absurd", "theater of absurd"),  # 'the' inside a word stays
        ("U.S.A.", "usa"),
    ],
)
def test_normalize_answer_articles_punctuation_case(text, expected):
    assert normalize_answer(text) == expected


def test_first_line_drops_leading_newlines_and_explanations():
    assert first_line("\n\n  Paris \nBecause the passage says so.") == "Paris"
    assert first_line("") == ""


def test_f1_partial_and_exact():
    assert f1_score("Exeter College", "exeter college.") == 1.0
    # precision 2/3, recall 1 -> F1 0.8
    assert f1_score("Exeter College Oxford", "Exeter College") == pytest.approx(0.8)
    assert f1_score("Oxford", "Exeter College") == 0.0
    assert f1_score("the", "a") == 1.0  # both normalise to nothing
    assert f1_score("Paris", "the") == 0.0


def test_gold_f1_uses_first_line_and_best_gold():
    generated = "The Atlantic Ocean.\nThe Amazon flows east into it."
    assert gold_f1(generated, ["Pacific", "atlantic ocean"]) == 1.0
    assert gold_f1("Atlantic", ["the Atlantic Ocean", "Atlantic"]) == 1.0
    assert gold_f1("\nParis\nLondon", ["London"]) == 0.0
    assert gold_f1("Paris", []) == 0.0


def test_answers_match_compares_first_lines():
    assert answers_match("Paris\nmore text", " Paris\nother text")
    assert not answers_match("Paris", "paris")


def test_kl_zero_and_top1_one_for_full_against_itself():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 4
    kl = token_kl(logits, logits.clone())
    assert kl.shape == (16,)
    assert torch.all(kl == 0)
    assert top1_agreement(logits, logits.clone()) == 1.0


def test_kl_positive_and_top1_partial_for_a_different_method():
    reference = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    other = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    kl = token_kl(reference, other)
    assert kl[0] == 0
    assert kl[1] > 1.0
    assert top1_agreement(reference, other) == 0.5
    # KL(p||q) by hand for the second row.
    p = torch.softmax(reference[1], -1)
    q = torch.softmax(other[1], -1)
    assert float(kl[1]) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-5)


def test_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="teacher-force both"):
        token_kl(torch.zeros(3, 5), torch.zeros(4, 5))


def test_recovery_is_zero_for_full_reuse_and_one_for_exact():
    assert recovery(0.174, 0.174) == 0.0
    assert recovery(0.0, 0.174) == 1.0
    assert recovery(0.087, 0.174) == pytest.approx(0.5)
    assert recovery(0.2, 0.1) < 0  # worse than full reuse
    assert recovery(0.1, 0.0) is None
    assert recovery(0.1, None) is None


def test_summarize_median_p90_mean():
    stats = summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert stats["median"] == 3.0
    assert stats["mean"] == 4.0
    assert stats["p90"] == pytest.approx(7.6)
    assert all(v is None for v in summarize([]).values())
    assert not math.isnan(summarize([5.0])["p90"])


def test_gold_exact_match_normalises_and_takes_any_gold():
    assert gold_exact_match("The Atlantic Ocean.\nBecause it flows west.", ["Pacific", "atlantic ocean"])
    assert not gold_exact_match("Atlantic", ["the Atlantic Ocean"])


def test_answer_in_text_matches_whole_normalised_words():
    text = "The Amazon flows into the Atlantic Ocean, near Belém."
    assert answer_in_text(["Pacific", "atlantic  ocean!"], text)
    assert answer_in_text(["Belém"], text)
    assert not answer_in_text(["Atlanta"], text)  # a word's prefix is not the word
    assert not answer_in_text(["the"], text)  # normalises to nothing: never "in" a text
    assert not answer_in_text([], text)


def test_bootstrap_interval_is_seeded_and_brackets_the_mean():
    diffs = [0.0, 0.5, -0.25, 1.0, 0.0, 0.0, -1.0, 0.25]
    low, high = bootstrap_interval(diffs, resamples=4000, seed=3)
    assert low < sum(diffs) / len(diffs) < high
    assert (low, high) == bootstrap_interval(diffs, resamples=4000, seed=3)
    assert bootstrap_interval([0.2] * 5) == pytest.approx((0.2, 0.2))
    assert bootstrap_interval([0.3]) is None
    narrow = bootstrap_interval(diffs, confidence=0.5)
    assert low <= narrow[0] <= narrow[1] <= high
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_interval(diffs, confidence=1.5)


def test_recovery_interval_resamples_questions_with_their_full_reuse():
    method, reuse = [0.1, 0.5, 0.2, 0.9, 0.3], [0.4, 0.6, 0.5, 1.0, 0.2]
    low, high = recovery_interval(method, reuse, resamples=4000, seed=1)
    assert low < recovery(sum(method) / 5, sum(reuse) / 5) < high
    assert (low, high) == recovery_interval(method, reuse, resamples=4000, seed=1)
    # every question at half its full reuse: every resample recovers exactly half
    assert recovery_interval([0.1, 0.3, 0.2], [0.2, 0.6, 0.4]) == pytest.approx((0.5, 0.5))
    assert recovery_interval([0.1], [0.2]) is None
    assert recovery_interval([0.0, 0.0], [0.0, 0.0]) is None  # full reuse exact: no recovery to speak of
    with pytest.raises(ValueError, match="pair them"):
        recovery_interval([0.1, 0.2], [0.3])
