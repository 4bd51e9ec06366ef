"""Calibration on a tiny model: the choice against a reachable and an unreachable target, the saved
result used by the engine (and only by the engine of the same model), a corrupt file ignored, a
stopped run resumed without redoing its work, and the command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cacheblend_rag import BlendConfig
from cacheblend_rag.calibration.commands import run_calibration
from cacheblend_rag.calibration.measure import (
    DEFAULT_CANDIDATES,
    Candidate,
    CalibrationTarget,
    calibrate,
    parse_candidates,
)
from cacheblend_rag.bench.prompt import MusiqueExample, build_prompt
from cacheblend_rag.cli import build_parser
from cacheblend_rag.data import demo_corpus_dir, load_demo_questions
from cacheblend_rag.engine import CachedSegment, FreshSegment
from cacheblend_rag.calibration import lookup as calibrated
from cacheblend_rag.calibration.lookup import calibration_path, load_calibration, parse_document
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.catalog import lookup
from cacheblend_rag.testing import tiny_engine

from calibration_fixtures import (  # noqa: F401 (fixtures, shared with the other calibration tests)
    CANDIDATES, _one_thread, _own_calibration_dir, engine, measured, prompts,
)



class Counting:
    """Counts the engine's blends and full prefills (the work a calibration does)."""

    def __init__(self, engine, monkeypatch, fail_after: int | None = None) -> None:
        self.calls = 0
        for name in ("blend", "full_prefill"):
            original = getattr(engine, name)

            def counted(*args, _original=original, **kwargs):
                if fail_after is not None and self.calls >= fail_after:
                    raise KeyboardInterrupt  # as Ctrl-C midway
                self.calls += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(engine, name, counted)


def test_a_reachable_target_picks_the_cheapest_setting_that_meets_it(measured):
    result, _ = measured
    assert result.target_met and "target met" in result.message
    rows = result.candidates
    assert [r.cost for r in rows] == sorted(r.cost for r in rows)
    meeting = [r for r in rows if r.meets_target]
    assert result.chosen is meeting[0]
    assert all(not r.meets_target for r in rows if r.cost < result.chosen.cost)
    assert result.chosen.recovery >= 0.8 and result.chosen.worse_than_full_reuse == 0
    # Ratio 1.0 is full prefill in all but the last layer's MLP: exact, and costs the most of the blends.
    exact = next(r for r in rows if r.name == "kv_deviation@1")
    assert exact.recovery == pytest.approx(1.0, abs=1e-3) and exact.cost == max(r.cost for r in rows)
    assert result.full_reuse.kl > 0 and result.full_reuse.recovery is None
    table = result.table()
    assert "full_reuse" in table and result.chosen.name in table


def test_an_unreachable_target_is_said_plainly_and_the_best_setting_is_used(engine, prompts, measured):
    _, state = measured
    result = calibrate(engine, prompts, CANDIDATES, CalibrationTarget(recovery=1.01), progress=False,
                       state_path=state)
    assert not result.target_met and "NOT reached" in result.message
    safe = [r for r in result.candidates if r.worse_than_full_reuse == 0] or result.candidates
    assert result.chosen.kl == min(r.kl for r in safe)
    assert result.chosen.name in result.message
    saved = result.save()
    assert json.loads(saved.read_text())["target_met"] is False  # saved all the same: the best measured is used
    assert engine.calibration().name == result.chosen.name


def test_full_reuse_is_chosen_when_every_candidate_is_further_from_full_prefill(engine, prompts, measured, tmp_path):
    _, state = measured
    document = json.loads(state.read_text())
    for entry in document["prompts"].values():  # every blend made worse than full reuse on every prompt
        reuse_kl = entry["methods"]["full_reuse"]["kl"]
        for key, measurement in entry["methods"].items():
            if key != "full_reuse":
                measurement["kl"] = reuse_kl + 1.0
    worse = tmp_path / "worse.json"
    worse.write_text(json.dumps(document))
    prompts_before = len(document["prompts"])
    result = calibrate(engine, prompts, CANDIDATES, progress=False, state_path=worse)
    assert len(json.loads(worse.read_text())["prompts"]) == prompts_before  # measured nothing again
    assert not result.target_met and result.chosen is result.full_reuse
    assert "Full reuse is used" in result.message and "further from full prefill than full reuse" in result.message
    result.save()
    assert engine.calibration().name == "full_reuse"
    assert engine.default_config().recompute_ratio == 0.0


def test_out_of_reach_a_setting_that_keeps_every_prompt_no_worse_than_full_reuse_comes_first(engine, prompts,
                                                                                             measured, tmp_path):
    _, state = measured
    document = json.loads(state.read_text())
    entries = list(document["prompts"].values())
    keys = [k for k in entries[0]["methods"] if k != "full_reuse"]
    lowest, runner_up = keys[0], keys[1]
    for number, entry in enumerate(entries):
        reuse_kl = entry["methods"]["full_reuse"]["kl"]
        for key in keys:  # every setting halfway between full prefill and full reuse...
            entry["methods"][key]["kl"] = 0.5 * reuse_kl
        # ...but the lowest in mean KL is far better on two prompts and worse than full reuse on the third
        entry["methods"][lowest]["kl"] = 1.2 * reuse_kl if number == 0 else 0.0
        entry["methods"][runner_up]["kl"] = 0.45 * reuse_kl
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    result = calibrate(engine, prompts, CANDIDATES, CalibrationTarget(recovery=0.9), progress=False, state_path=edited)
    by_key = {r.name: r for r in result.candidates}
    assert not result.target_met and result.chosen.worse_than_full_reuse == 0
    assert result.chosen.kl < min(r.kl for r in result.candidates if r is not result.chosen and
                                  r.worse_than_full_reuse == 0) and result.chosen.kl > min(r.kl for r in by_key.values())
    assert "at most 0 prompts worse than full reuse" in result.message
    # With the allowance at one prompt, the lowest KL is within it and is chosen.
    allowed = calibrate(engine, prompts, CANDIDATES, CalibrationTarget(recovery=0.9, allow_worse=1), progress=False,
                        state_path=edited)
    assert allowed.chosen.kl == min(r.kl for r in allowed.candidates) and allowed.chosen.worse_than_full_reuse == 1


def test_a_cost_ceiling_is_never_crossed_met_or_not(engine, prompts, measured):
    _, state = measured
    free = calibrate(engine, prompts, CANDIDATES, CalibrationTarget(recovery=1.01), progress=False, state_path=state)
    exact = next(r for r in free.candidates if r.name == "kv_deviation@1")
    assert free.chosen is exact  # without a ceiling the best measured setting is the most expensive one

    ceiling = sorted(r.cost for r in free.candidates)[-2]  # everything but ratio 1.0 is affordable
    capped = calibrate(engine, prompts, CANDIDATES, CalibrationTarget(recovery=1.01, max_cost=ceiling),
                       progress=False, state_path=state)
    affordable = [r for r in capped.candidates if r.cost <= ceiling]
    assert not capped.target_met and "within the cost ceiling" in capped.message
    assert capped.chosen.kl == min(r.kl for r in affordable) and capped.chosen.cost <= ceiling

    reachable = calibrate(engine, prompts, CANDIDATES, CalibrationTarget(max_cost=ceiling), progress=False,
                          state_path=state)
    assert all(not r.meets_target for r in reachable.candidates if r.cost > ceiling)
    assert reachable.chosen.cost <= ceiling

    nothing = calibrate(engine, prompts, CANDIDATES, CalibrationTarget(max_cost=1e-9), progress=False,
                        state_path=state)
    assert not nothing.target_met and "every candidate costs more than the ceiling" in nothing.message
    assert nothing.chosen.cost == min(r.cost for r in nothing.candidates)
    for bad in (0, -0.5, float("nan"), True, "0.3"):
        with pytest.raises(ConfigError, match="max_cost"):
            CalibrationTarget(max_cost=bad)


def test_the_saved_result_is_the_engines_default_and_the_stats_say_so(engine, measured):
    result, _ = measured
    assert engine.config_source == "built-in" and engine.default_config() == BlendConfig()
    path = result.save()
    assert path == calibration_path(engine.fingerprint)
    assert engine.config_source == f"calibrated: {path}"
    assert engine.default_config().recompute_ratio == result.chosen.config["recompute_ratio"]
    assert engine.default_config().selection == result.chosen.config["selection"]

    ids = engine.tokenize("Paris is the capital of France. The quick brown fox jumps over the lazy dog.")
    segments = [engine.tokenize("Context:\n"), CachedSegment(engine.prefill_chunk(ids)), FreshSegment(ids[:4])]
    stats = engine.blend(segments).stats
    assert stats.config_source == f"calibrated: {path}" and stats.blend_setting == result.chosen.name.replace(
        "+prefix", "")
    given = engine.blend(segments, config=BlendConfig(recompute_ratio=0.3)).stats
    assert (given.config_source, given.blend_setting) == ("user", "query_profiled@0.3")
    # An engine built with a setting keeps it: the user's config wins over the calibrated one.
    own = tiny_engine("llama", config=BlendConfig(recompute_ratio=0.2))
    assert own.config_source == "user" and own.default_config().recompute_ratio == 0.2


def test_another_model_never_reads_this_models_result(engine, measured, caplog):
    result, _ = measured
    path = result.save()
    other = tiny_engine("llama", seed=1)
    assert other.fingerprint != engine.fingerprint
    assert other.calibration() is None and other.config_source == "built-in"
    # Named as the other model's file, the result is still refused: its fingerprint is checked inside.
    path.rename(calibration_path(other.fingerprint))
    with caplog.at_level(logging.WARNING):
        assert other.calibration() is None and other.config_source == "built-in"
    assert "measured on another model" in caplog.text


def test_a_setting_shipped_for_a_model_is_its_default_until_the_user_calibrates_it(engine, measured, tmp_path,
                                                                                   monkeypatch, caplog):
    result, _ = measured
    shipped_dir = tmp_path / "shipped"
    monkeypatch.setattr(calibrated, "SHIPPED_DIR", shipped_dir)
    mine = result.save()
    shipped_dir.mkdir()
    shipped = shipped_dir / mine.name
    mine.rename(shipped)
    assert engine.config_source == f"calibrated (shipped): {shipped}"
    assert engine.calibration().shipped
    assert engine.default_config() == BlendConfig().with_overrides(**result.chosen.config)
    other = tiny_engine("llama", seed=1)
    assert other.config_source == "built-in"  # the file is named by, and holds, this model's fingerprint only
    # The user's own calibration wins; a corrupt one is reported and the shipped one is used again.
    assert result.save() == mine and engine.config_source == f"calibrated: {mine}"
    mine.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert engine.config_source == f"calibrated (shipped): {shipped}"
    assert "ignoring the calibration result" in caplog.text


def test_every_shipped_setting_is_a_valid_calibration_of_a_catalog_model():
    files = sorted(calibrated.SHIPPED_DIR.glob("*.json"))
    assert files, f"no shipped settings in {calibrated.SHIPPED_DIR}"
    for path in files:
        setting = parse_document(json.loads(path.read_text()), path.stem, str(path), shipped=True)
        assert lookup(setting.model) is not None, f"{path}: {setting.model} is not in the model catalog"
        assert setting.source.startswith("calibrated (shipped): ")


@pytest.mark.parametrize("content, reason", [
    ("{not json", "Expecting property name"),
    ('{"format": "something else"}', "not a calibration result"),
    (None, "not a valid BlendConfig"),
])
def test_a_corrupt_result_is_reported_and_ignored(engine, measured, caplog, content, reason):
    result, _ = measured
    path = result.save()
    if content is None:
        document = json.loads(path.read_text())
        document["chosen"]["config"]["recompute_ratio"] = 7
        content = json.dumps(document)
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        assert engine.calibration() is None and engine.config_source == "built-in"
        assert engine.default_config() == BlendConfig()
    assert reason in caplog.text and "ignoring the calibration result" in caplog.text


def test_a_rerun_skips_what_is_measured_and_a_stop_leaves_a_valid_state(engine, prompts, measured, tmp_path,
                                                                         monkeypatch):
    _, state = measured
    with monkeypatch.context() as patch:
        counting = Counting(engine, patch)
        calibrate(engine, prompts, CANDIDATES, progress=False, state_path=state)
        assert counting.calls == 0  # everything was in the state file

    partial = tmp_path / "partial.json"
    with monkeypatch.context() as patch:
        Counting(engine, patch, fail_after=5)
        with pytest.raises(KeyboardInterrupt):
            calibrate(engine, prompts, CANDIDATES, progress=False, state_path=partial, resume=False)
    saved = json.loads(partial.read_text())  # valid JSON after the stop
    done = sum(len(p["methods"]) for p in saved["prompts"].values())
    assert done == 4  # the first prompt's full prefill, then 4 of its 5 settings (full reuse and 4 candidates)
    with monkeypatch.context() as patch:
        counting = Counting(engine, patch)
        resumed = calibrate(engine, prompts, CANDIDATES, progress=False, state_path=partial)
    # The first prompt: its full prefill again (the teacher's logits are not kept) and its last setting;
    # the other two prompts: everything.
    assert counting.calls == (1 + 1) + 2 * (1 + 5)
    first = calibrate(engine, prompts, CANDIDATES, progress=False, state_path=measured[1])
    assert [r.kl for r in resumed.candidates] == pytest.approx([r.kl for r in first.candidates], abs=1e-6)


def test_candidates_parse_like_methods_and_the_default_grid_is_valid():
    grid = parse_candidates()
    assert len(grid) == len(DEFAULT_CANDIDATES)
    assert Candidate(BlendConfig(), condition_chunks=True) in grid  # the built-in default is a candidate
    mine = parse_candidates("kv_deviation@0.15,cacheblend@0.15,query_profiled+prefix@0.3")
    assert [c.name for c in mine] == ["kv_deviation@0.15", "query_profiled+prefix@0.3"]
    assert len({c.key for c in grid}) == len(grid)
    for bad, message in [("full_prefill", "reuses no chunk KV"), ("kv_deviation@0.15:int8", "storage"),
                         ("nonsense@0.1", "unknown method")]:
        with pytest.raises(ConfigError, match=message):
            parse_candidates(bad)
    with pytest.raises(ConfigError, match="allow_worse"):
        CalibrationTarget(allow_worse=-1)


def test_the_command_calibrates_a_corpus_and_saves_where_the_engine_looks(engine, tmp_path, capsys):
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(q.question for q in load_demo_questions()[:2]))
    out = tmp_path / "out"
    args = build_parser().parse_args([
        "calibrate", "--corpus", str(demo_corpus_dir()), "--questions", str(questions), "--passages", "2",
        "--max-passage-tokens", "30", "--candidates", "kv_deviation@0.2,kv_deviation@1.0", "--teacher-tokens", "4",
        "--target-recovery", "0.9", "--out", str(out), "--no-progress",
    ])
    assert run_calibration(args, engine=engine) == 0
    printed = capsys.readouterr().out
    assert "| kv_deviation@1 |" in printed and "target met" in printed
    saved = load_calibration(engine.fingerprint, out)
    assert saved is not None and saved.document["prompts"] == 2
    assert (out / f"{engine.fingerprint}.state.json").exists()
    assert Path(saved.document["data"]["corpus"]) == demo_corpus_dir()
    assert saved.document["target"] == {"recovery": 0.9, "allow_worse": 0, "max_cost": None, "min_top1": None,
                                        "min_identical_answers": None}
    capped = build_parser().parse_args(["calibrate", "--corpus", "c", "--questions", "q", "--max-cost", "0.29"])
    assert capped.max_cost == 0.29


def test_the_cost_may_be_measured_ttft(engine, prompts, measured):
    _, state = measured
    result = calibrate(engine, prompts, CANDIDATES, cost="ttft", progress=False, state_path=state)
    assert result.cost_kind == "ttft" and all(r.cost > 0 for r in result.candidates)
    assert [r.cost for r in result.candidates] == sorted(r.cost for r in result.candidates)
    with pytest.raises(ConfigError, match="cost="):
        calibrate(engine, prompts, CANDIDATES, cost="seconds", progress=False)


def test_prompts_from_a_jsonl_of_questions_and_passages(tmp_path):
    from cacheblend_rag.calibration.commands import load_examples

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"question": "Q1?", "passages": ["one", {"title": "T", "text": "two"}]}) + "\n\n"
                    + json.dumps({"question": "Q2?", "passages": ["three"], "answers": "x"}) + "\n")
    args = build_parser().parse_args(["calibrate", "--data", str(data)])
    examples = load_examples(args)
    assert [(e.question, e.passages, e.answers) for e in examples] == [
        ("Q1?", [("", "one"), ("T", "two")], []), ("Q2?", [("", "three")], ["x"])]
    data.write_text('{"question": "Q?"}\n')
    with pytest.raises(ConfigError, match="line 1"):
        load_examples(args)


def test_warm_computes_chunks_as_the_calibration_chose(tmp_path, capsys):
    from langchain_cacheblend import ChatCacheBlend

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.cli import main as cli_main
    from cacheblend_rag.testing import save_tiny_model

    folder = save_tiny_model(tmp_path / "model")
    loaded = CacheBlendEngine.from_pretrained(str(folder))
    chunks = ["Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
              "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean."]
    prompt = build_prompt(loaded.tokenizer, MusiqueExample("Where is Paris?", [], [("", c) for c in chunks]),
                          passages=2)
    result = calibrate(loaded, [prompt], "kv_deviation@1.0", teacher_tokens=2, progress=False)
    result.save()
    assert not result.chosen.condition_chunks
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(chunks))
    store = tmp_path / "kv"
    assert cli_main(["warm", "--model", str(folder), "--path", str(store), "--no-progress", str(corpus)]) == 0
    assert "computing chunks alone" in capsys.readouterr().err
    # The integration, left to its defaults, computes chunks alone too, and finds every one warm wrote.
    chat = ChatCacheBlend(model=str(folder), store_path=str(store), max_tokens=3)
    assert chat.config_source.startswith("calibrated") and not chat.conditions_chunks
    assert chat.warm(chunks, show_progress=False).present == 2


def test_with_answerable_n_counts_the_prompts_that_hold_their_answer(engine, tmp_path, capsys):
    from cacheblend_rag.calibration.commands import build_prompts, load_examples

    def item(question: str, answer: str, text: str) -> str:
        return json.dumps({"question": question, "answers": [answer], "passages": [text, "filler words here"]})

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join([item("Q0?", "paris", "Paris is a city."), item("Q1?", "rome", "No answer here."),
                               item("Q2?", "oslo", "Oslo is a city."), item("Q3?", "bern", "Bern is a city.")]))
    args = build_parser().parse_args(["calibrate", "--data", str(data), "--n", "2", "--answerable"])
    def cities(prompts) -> list[str]:
        return [p.passage_texts[0].split()[0] for p in prompts]

    # the first two that hold their answer: Q0 and Q2, not Q0 alone of the first two read
    assert cities(build_prompts(engine, load_examples(args), args)) == ["Paris", "Oslo"]
    assert "3 of 4 questions hold their gold answer" in capsys.readouterr().err
    plain = build_parser().parse_args(["calibrate", "--data", str(data), "--n", "2"])
    assert cities(build_prompts(engine, load_examples(plain), plain)) == ["Paris", "No"]
