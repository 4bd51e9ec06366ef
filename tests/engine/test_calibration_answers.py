"""Calibration targets on answers: top-1 agreement with full prefill under teacher forcing and the share of greedy
answers identical to full prefill's, measured for every setting (identity read off teacher forcing, checked here
against real greedy decoding), recorded in the saved result, and chosen by: a target on answers picks a costlier
setting than KL alone where the answers demand it, and one out of reach is said, with what the best got."""

from __future__ import annotations

import json
import logging

import pytest

from cacheblend_rag.calibration import measure as calibration_module
from cacheblend_rag.calibration.commands import run_calibration
from cacheblend_rag.calibration.measure import CalibrationTarget, calibrate, parse_candidates, prompt_key
from cacheblend_rag.bench.requests import BlendRequest, FullPrefillRequest, run_request
from cacheblend_rag.bench.stores import ChunkStoreFactory
from cacheblend_rag.cli import build_parser
from cacheblend_rag.data import demo_corpus_dir, load_demo_questions
from cacheblend_rag.calibration.lookup import load_calibration
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.errors import ConfigError

from calibration_fixtures import (  # noqa: F401 (fixtures, shared with the other calibration tests)
    CANDIDATES, _one_thread, _own_calibration_dir, engine, measured, prompts,
)

TEACHER = 16  # calibrate's default


def stubbed(state, tmp_path, answers: dict[str, tuple[float, bool]], default: tuple[float, bool]):
    """A copy of the state file with each setting's answers set: ``answers[name]`` (top-1, identical) on every
    prompt, ``default`` for the others (full reuse too). The KLs, costs and prompts stay as measured."""
    document = json.loads(state.read_text())
    for entry in document["prompts"].values():
        for key, measurement in entry["methods"].items():
            measurement["top1"], measurement["identical"] = answers.get(key.partition("#")[0], default)
    path = tmp_path / "stubbed.json"
    path.write_text(json.dumps(document))
    return path


def calibrate_from(engine, prompts, state, target, monkeypatch):
    """Calibrate from a state file holding every measurement; measuring anything would fail the test."""
    with monkeypatch.context() as patch:
        for name in ("blend", "full_prefill"):
            patch.setattr(engine, name, lambda *a, **k: pytest.fail("measured again; the state holds everything"))
        return calibrate(engine, prompts, CANDIDATES, target, progress=False, state_path=state)


def test_every_setting_gets_top1_and_identical_answers_and_the_exact_one_keeps_all(measured):
    result, _ = measured
    for row in [result.full_reuse, *result.candidates]:
        assert 0.0 <= row.top1 <= 1.0 and row.identical_answers in (0.0, 1 / 3, 2 / 3, 1.0)
    exact = next(r for r in result.candidates if r.name == "kv_deviation@1")
    assert exact.top1 == 1.0 and exact.identical_answers == 1.0
    assert result.full_reuse.identical_answers < 1.0  # the tiny model's answers do move without a blend
    document = result.to_document()
    assert document["target"]["min_top1"] is None and document["target"]["min_identical_answers"] is None
    assert all({"top1", "identical_answers"} <= set(row) for row in document["table"])
    assert {"top1", "identical_answers"} <= set(document["chosen"])
    assert "| top-1 | identical answers |" in result.table()


def test_identity_read_off_teacher_forcing_is_what_greedy_decoding_gives(engine, prompts, measured):
    _, state = measured
    saved = json.loads(state.read_text())["prompts"]
    eos = eos_token_ids(engine)
    stores = ChunkStoreFactory("memory", engine)
    try:
        for prompt in prompts:
            entry = saved[prompt_key(prompt, TEACHER)]
            reference = run_request(engine, FullPrefillRequest(engine, prompt.input_ids), max_new_tokens=TEACHER,
                                    eos_ids=eos, teacher_limit=0)
            for candidate in parse_candidates(CANDIDATES):
                cache = stores.open(prompt.conditioning_prefix(candidate.condition_chunks))
                cache.warm(prompt.chunk_ids)
                cache.warm([prompt.lead_ids], prefix_ids=(), lossless=True)
                segments = prompt.stored_segments(prompt.conditioning_prefix(candidate.condition_chunks))
                config = candidate.config.with_overrides(min_blend_tokens=0)
                run = run_request(engine, BlendRequest(engine, segments, config, cache), max_new_tokens=TEACHER,
                                  eos_ids=eos, teacher_limit=0)
                stores.release(cache)
                decoded_same = run.answer_tokens(TEACHER) == reference.answer_tokens(TEACHER)
                assert entry["methods"][candidate.key]["identical"] == decoded_same, candidate.name
    finally:
        stores.close()


def test_answer_targets_choose_a_costlier_setting_than_kl_alone(engine, prompts, measured, tmp_path, monkeypatch):
    result, state = measured
    by_kl = result.chosen  # the cheapest that meets the KL target
    costlier = [r for r in result.candidates if r.cost > by_kl.cost and r.meets_target]
    assert costlier, "the grid needs a costlier setting that meets the KL target"
    keeper = costlier[0]
    # Every setting changes two answers in three and agrees on 80% of tokens, but for the costlier one.
    path = stubbed(state, tmp_path, {keeper.name: (0.95, True)}, default=(0.8, False))
    kl_only = calibrate_from(engine, prompts, path, CalibrationTarget(), monkeypatch)
    assert kl_only.chosen.name == by_kl.name  # answers are recorded, not asked for
    for target in (CalibrationTarget(min_identical_answers=0.6), CalibrationTarget(min_top1=0.9),
                   CalibrationTarget(min_top1=0.9, min_identical_answers=1.0)):
        chosen = calibrate_from(engine, prompts, path, target, monkeypatch)
        assert chosen.target_met and chosen.chosen.name == keeper.name and chosen.chosen.cost > by_kl.cost
        assert [r.name for r in chosen.candidates if r.meets_target] == [keeper.name]
        assert chosen.message.startswith("target met") and f"{keeper.name} is the cheapest" in chosen.message
        # The message says what the chosen setting got on what was asked, and only that.
        assert ("top-1 0.950" in chosen.message) == (target.min_top1 is not None)
        assert ("identical answers 1.00)" in chosen.message) == (target.min_identical_answers is not None)
    document = json.loads(chosen.save().read_text())
    assert document["target"]["min_top1"] == 0.9 and document["target"]["min_identical_answers"] == 1.0
    assert document["chosen"]["name"] == keeper.name and document["chosen"]["identical_answers"] == 1.0
    table = {row["name"]: row for row in document["table"]}
    assert table[keeper.name]["top1"] == pytest.approx(0.95) and table[by_kl.name]["identical_answers"] == 0.0
    assert engine.calibration().name == keeper.name


def test_an_answer_target_out_of_reach_is_said_with_what_the_best_got(engine, prompts, measured, tmp_path,
                                                                      monkeypatch):
    _, state = measured
    keeps_most = "kv_deviation@0.5"
    path = stubbed(state, tmp_path, {keeps_most: (0.7, True), "kv_deviation@1": (0.9, False)}, default=(0.5, False))
    result = calibrate_from(engine, prompts, path, CalibrationTarget(min_top1=0.95, min_identical_answers=0.9),
                            monkeypatch)
    assert not result.target_met and not any(r.meets_target for r in result.candidates)
    message = result.message
    assert message.startswith("target NOT reached: no candidate setting gives recovery >= 0.8")
    assert "top-1 agreement >= 0.95, identical answers >= 0.9" in message
    assert "Best measured: " in message and "top-1 0.900 (kv_deviation@1)" in message
    assert f"identical answers 1.00 ({keeps_most})" in message
    # The answers come first out of reach: the setting that keeps the most answers, said with what it got.
    assert result.chosen.name == keeps_most and "most identical answers, then highest top-1, then lowest KL" in message
    assert f"{keeps_most} (" in message and "identical answers 1.00)" in message
    assert json.loads(result.save().read_text())["target_met"] is False


def test_the_command_takes_answer_targets_and_prints_them(engine, tmp_path, capsys, monkeypatch):
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(q.question for q in load_demo_questions()[:2]))
    out = tmp_path / "out"
    argv = ["calibrate", "--corpus", str(demo_corpus_dir()), "--questions", str(questions), "--passages", "2",
            "--max-passage-tokens", "30", "--candidates", "kv_deviation@0.2,kv_deviation@1.0", "--teacher-tokens", "4",
            "--out", str(out), "--no-progress", "--min-top1", "0.9", "--min-identical-answers", "0.5"]
    # Stubbed: every setting agrees with full prefill on half its answer tokens, so no setting reaches 0.9.
    monkeypatch.setattr(calibration_module, "top1_agreement", lambda reference, logits: 0.5)
    assert run_calibration(build_parser().parse_args(argv), engine=engine) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("target: recovery >= 0.8 with at most 0 of 2 prompts worse than full reuse, top-1 "
                              "agreement >= 0.9, identical answers >= 0.5; cost work; measured on cpu in float32")
    assert "| top-1 | identical answers |" in printed and "| 0.500 |" in printed
    assert "target NOT reached" in printed and "top-1 0.500" in printed
    saved = load_calibration(engine.fingerprint, out)
    assert saved.document["target"]["min_top1"] == 0.9 and saved.document["target"]["min_identical_answers"] == 0.5
    assert saved.document["device"] == "cpu" and not saved.target_met
    for bad in ("1.5", "-0.1", "nan"):
        args = build_parser().parse_args(argv[:-2] + ["--min-identical-answers", bad])
        with pytest.raises(ConfigError, match="--min-identical-answers.*between 0 and 1"):
            run_calibration(args, engine=engine)
    with pytest.raises(ConfigError, match="--min-top1"):
        CalibrationTarget(min_top1=True)


def test_a_state_saved_before_answers_were_measured_is_measured_again(engine, prompts, measured, tmp_path, caplog):
    _, state = measured
    document = json.loads(state.read_text())
    for entry in document["prompts"].values():
        for measurement in entry["methods"].values():
            del measurement["top1"], measurement["identical"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING):
        again = calibrate(engine, prompts, CANDIDATES, progress=False, state_path=old)
    assert "15 entries were saved before answers were measured" in caplog.text and "malformed" not in caplog.text
    assert [r.identical_answers for r in again.candidates] == [r.identical_answers for r in measured[0].candidates]
