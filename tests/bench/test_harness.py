"""The harness end to end on two tiny questions with a tiny model: the JSON's shape and the reference identities."""

from __future__ import annotations

import json

import pytest

from cacheblend_rag.bench import BenchConfig, run_benchmark
from cacheblend_rag.bench.plot import plot_recovery_by_ratio, plot_speedup_vs_kl
from cacheblend_rag.bench.report import answer_table, describe_run, markdown_table, strategy_grid_table, write_json
from cacheblend_rag.errors import ConfigError

FAST = dict(max_new_tokens=4, teacher_tokens=4, throughput_new_tokens=4, throughput_requests=1, show_progress=False)

METHOD_KEYS = {
    "name", "family", "kind", "selection", "ratio", "prefix_conditioned", "storage", "examples", "ttft_s", "ttft_measured",
    "ttft_speedup",
    "cold_ttft_s", "decode_tokens_per_s", "throughput_rps", "throughput_requests", "precompute",
    "recompute_fraction", "quality", "added_as_reference",
}
QUALITY_KEYS = {"f1", "gold_em", "f1_delta", "f1_delta_ci95", "kl", "kl_median", "top1", "recovery", "recovery_ci95",
                "exact_match", "worse_than_full_reuse"}
EXAMPLE_METHOD_KEYS = {"answer", "f1", "gold_exact_match", "exact_match", "kl", "top1", "ttft_s", "decode_tokens_per_s", "cold_ttft_s",
                       "throughput_request_s", "stats", "diagnostics"}


@pytest.fixture(scope="module")
def document(engine, musique_file):
    config = BenchConfig(
        data=str(musique_file), passages=3, ratios="0.5,1.0", repeats=2,
        methods="prefix_caching,cacheblend,sink_aware+prefix", **FAST,
    )
    return run_benchmark(config, engine=engine)


def by_name(document):
    return {m["name"]: m for m in document["methods"]}


def test_document_shape(document):
    assert document["schema_version"] == 1
    for key in ("created_utc", "command", "args", "git", "machine", "model", "blend_config", "store", "data",
                "elapsed_s", "methods", "examples"):
        assert key in document, key
    for key in ("cpu", "cpu_count", "usable_cores", "torch_threads", "torch", "transformers", "python"):
        assert key in document["machine"], key
    assert set(document["git"]) == {"commit", "dirty"}
    assert document["args"]["passages"] == 3 and document["args"]["ratios"] == [0.5, 1.0]
    assert document["data"]["examples"] == 2
    json.dumps(document)  # serialisable as is

    methods = by_name(document)
    assert list(methods) == [
        "full_prefill", "full_reuse", "prefix_caching", "cacheblend@0.5", "cacheblend@1",
        "sink_aware+prefix@0.5", "sink_aware+prefix@1",
    ]
    assert methods["full_reuse"]["added_as_reference"] and not methods["cacheblend@0.5"]["added_as_reference"]
    for summary in methods.values():
        assert set(summary) == METHOD_KEYS
        assert set(summary["quality"]) == QUALITY_KEYS
        assert set(summary["ttft_s"]) == {"median", "p90", "mean"}
        assert summary["ttft_s"]["median"] > 0
        assert summary["throughput_rps"] > 0 and summary["throughput_requests"] == 1
        assert summary["cold_ttft_s"] > 0
        assert (summary["precompute"] is not None) == (summary["kind"] in ("full_reuse", "blend"))

    assert len(document["examples"]) == 2
    for example in document["examples"]:
        assert set(example["methods"]) == set(methods)
        assert example["prompt_tokens"] > sum(example["chunk_tokens"]) > 0
        assert set(example["precompute_s"]) == {"plain", "prefix"}
        for outcome in example["methods"].values():
            assert set(outcome) == EXAMPLE_METHOD_KEYS
            assert len(outcome["ttft_s"]) == 2
            assert (outcome["cold_ttft_s"] is not None) == (example["index"] == 0)


def test_reference_identities(document):
    methods = by_name(document)
    full = methods["full_prefill"]["quality"]
    assert full["kl"] == 0.0 and full["top1"] == 1.0 and full["exact_match"] == 1.0
    assert full["f1_delta"] == 0.0 and full["f1_delta_ci95"] is None
    for name in ("prefix_caching", "cacheblend@1"):  # exact methods answer as full prefill does
        assert methods[name]["quality"]["f1_delta"] == pytest.approx(0.0)
        assert methods[name]["quality"]["f1_delta_ci95"] == pytest.approx([0.0, 0.0])
    for m in methods.values():
        low, high = m["quality"]["f1_delta_ci95"] or (m["quality"]["f1_delta"],) * 2
        assert low <= m["quality"]["f1_delta"] <= high
    assert document["data"]["selection"] == {"answerable": False, "kept": 2, "of": 2}
    assert methods["full_prefill"]["ttft_speedup"] == pytest.approx(1.0)
    reuse = methods["full_reuse"]["quality"]
    assert reuse["recovery"] == 0.0 and reuse["worse_than_full_reuse"] == 0
    assert reuse["recovery_ci95"] is None and methods["full_prefill"]["quality"]["recovery_ci95"] is None
    low, high = methods["cacheblend@0.5"]["quality"]["recovery_ci95"]
    assert low <= methods["cacheblend@0.5"]["quality"]["recovery"] <= high
    assert reuse["kl"] > 0  # the tiny random model does notice the missing cross-attention
    # Exact methods: prefix caching, and blending at ratio 1.
    for name in ("prefix_caching", "cacheblend@1", "sink_aware+prefix@1"):
        quality = methods[name]["quality"]
        assert quality["kl"] < 1e-6 and quality["top1"] == 1.0, name
        assert quality["recovery"] == pytest.approx(1.0, abs=1e-4), name
    assert methods["cacheblend@0.5"]["recompute_fraction"] == pytest.approx(0.5, abs=0.02)


def test_table_and_plot(document, tmp_path):
    table = markdown_table(document)
    rows = table.splitlines()
    assert rows[0].startswith("| method | TTFT median (s)")
    assert len(rows) == 2 + len(document["methods"])
    assert any(r.startswith("| cacheblend@0.5 |") for r in rows)
    png = plot_speedup_vs_kl(document, tmp_path / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = write_json(document, tmp_path / "sub" / "r.json")
    assert json.loads(out.read_text())["methods"] == document["methods"]


def test_answer_table(document):
    rows = answer_table(document).splitlines()
    assert rows[0] == ("| method | F1 | EM | ΔF1 vs full prefill [95% CI] | KL | top-1 | recovery [95% CI] | "
                       "TTFT speedup |")
    full = next(r for r in rows if r.startswith("| full_prefill |"))
    assert "| +0.000 |" in full and full.endswith("| 1.00x |")
    assert "[+0.000, +0.000]" in next(r for r in rows if r.startswith("| cacheblend@1 |"))


def test_answerable_keeps_questions_whose_answer_is_in_the_prompt(engine, tmp_path, capsys):
    ctxs = [{"title": "Rivers", "text": "Many long rivers cross the continent and the longest flows into the Atlantic"},
            {"title": "Capitals", "text": "Of all the cities on that river, the oldest capital is Paris"},
            {"title": "", "text": "Marie Curie was a physicist and chemist."}]
    questions = [{"question": "Who wrote Hamlet?", "answers": ["Shakespeare"], "ctxs": ctxs},
                 {"question": "Where does it flow into?", "answers": ["the Atlantic Ocean", "Atlantic"], "ctxs": ctxs},
                 {"question": "Which capital?", "answers": ["paris."], "ctxs": ctxs}]
    data = tmp_path / "mixed.json"
    data.write_text(json.dumps(questions))
    config = BenchConfig(data=str(data), passages=3, methods="full_reuse", answerable=True, cold_examples=1, **FAST)
    document = run_benchmark(config, engine=engine)
    assert document["data"]["selection"] == {"answerable": True, "kept": 2, "of": 3}
    assert [e["index"] for e in document["examples"]] == [1, 2]  # places in the data, not in the run
    assert document["examples"][0]["methods"]["full_reuse"]["cold_ttft_s"] is not None  # first of the run
    assert "kept 2 of 3" in describe_run(document)
    # Cut to one token per passage, no answer is left in any prompt: an error that says what to change.
    with pytest.raises(ConfigError, match="kept none of the 3 questions.*--max-passage-tokens"):
        run_benchmark(BenchConfig(data=str(data), passages=3, max_passage_tokens=1, methods="full_reuse",
                                  answerable=True, **FAST), engine=engine)


def test_restrict_document_summarises_again(document):
    from cacheblend_rag.bench.summary import restrict_document

    same = restrict_document(json.loads(json.dumps(document)), [0, 1])
    assert [m["quality"] for m in same["methods"]] == [m["quality"] for m in document["methods"]]
    first = restrict_document(document, [0])
    assert first["data"]["examples"] == 1 and [e["index"] for e in first["examples"]] == [0]
    f1 = {n: o["f1"] for n, o in document["examples"][0]["methods"].items()}
    assert {m["name"]: m["quality"]["f1"] for m in first["methods"]} == f1
    with pytest.raises(ConfigError, match="none of the questions"):
        restrict_document(document, [7])


def test_answer_tables_script_compares_runs_on_common_questions(document, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    both, first = tmp_path / "both.json", tmp_path / "first.json"
    write_json(document, both)
    write_json({**document, "examples": document["examples"][:1]}, first)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "answer_tables.py"
    out = subprocess.run([sys.executable, str(script), str(both), str(first)], capture_output=True, text=True, check=True)
    assert "questions common to every run (1): [0]" in out.stdout
    assert out.stdout.count("| method | F1 | EM | ΔF1 vs full prefill [95% CI]") == 2


def test_partial_documents_after_every_method(engine, musique_file):
    seen = []
    config = BenchConfig(data=str(musique_file), passages=2, ratios="0.5", methods="full_reuse", cold_examples=0, **FAST)
    final = run_benchmark(config, engine=engine, on_partial=seen.append)
    # full_prefill, then full_reuse, on each question in turn
    assert [(d["partial"], d["data"]["examples"]) for d in seen] == [(True, 1), (True, 1), (True, 2), (False, 2)]
    assert [m["examples"] for m in seen[0]["methods"]] == [1, 0]  # a question in progress is summarised as it is
    assert final["partial"] is False and final["methods"][0]["examples"] == 2


def test_strategy_grid_and_recovery_plot(document, tmp_path):
    rows = strategy_grid_table(document, focus=0.5).splitlines()
    assert rows[0].startswith("| method | recovery @ 0.5 / 1 |")
    by_family = {r.split(" | ")[0].lstrip("| "): r for r in rows[2:]}
    assert set(by_family) == {"full_reuse", "cacheblend", "sink_aware+prefix"}
    # Plain CacheBlend is the TTFT reference of its own row; full reuse recovers nothing by definition.
    assert by_family["cacheblend"].endswith("| 1.00 |")
    assert by_family["full_reuse"].split(" | ")[1] == "0% / 0%"
    png = plot_recovery_by_ratio(document, tmp_path / "recovery.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_disk_store(engine, musique_file, tmp_path):
    config = BenchConfig(data=str(musique_file), n=1, passages=2, ratios="0.5", methods="cacheblend",
                         store="disk", store_dir=str(tmp_path), cold_examples=0, **FAST)
    document = run_benchmark(config, engine=engine)
    assert document["store"]["kind"] == "disk"
    assert [m["name"] for m in document["methods"]] == ["full_prefill", "full_reuse", "cacheblend@0.5"]
    assert document["methods"][2]["cold_ttft_s"] is None
    assert list(tmp_path.iterdir()) == []  # every store the run opened is gone


def test_cli_end_to_end(engine, musique_file, tmp_path, capsys):
    from cacheblend_rag.cli import main

    model_dir = tmp_path / "tiny-model"
    engine.model.save_pretrained(model_dir)
    engine.tokenizer.save_pretrained(model_dir)
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    code = main([
        "bench", "--data", str(musique_file), "--model", str(model_dir), "--device", "cpu", "--n", "1",
        "--passages", "2", "--methods", "full_prefill,full_reuse,cacheblend", "--ratios", "0.3",
        "--max-new-tokens", "4", "--teacher-tokens", "4", "--throughput-new-tokens", "4",
        "--throughput-requests", "1", "--no-progress", "--out", str(out), "--plot", str(plot), "--answerable",
    ])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| method | TTFT median (s)" in stdout and "| cacheblend@0.3 |" in stdout
    assert "| method | F1 | EM | ΔF1 vs full prefill [95% CI]" in stdout and "kept 1 of 1" in stdout
    assert json.loads(out.read_text())["data"]["examples"] == 1
    assert plot.exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_new_tokens=8, teacher_tokens=16), "max_new_tokens=8 is below teacher_tokens=16"),
        (dict(repeats=0), "repeats=0"),
        (dict(store="redis"), "store='redis'"),
        (dict(prefix_conditioned="yes"), "prefix_conditioned='yes'"),
        (dict(throughput_requests=-1), "throughput_requests=-1"),
    ],
)
def test_config_errors_name_the_field(overrides, message, musique_file):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        BenchConfig(data=str(musique_file), **overrides)


def test_blend_options_reach_the_blend_config(engine, musique_file):
    from cacheblend_rag.bench.commands import parse_blend_options

    options = parse_blend_options(["sink_tokens=2", "mask=bottom_right"])
    assert options == {"sink_tokens": 2, "mask": "bottom_right"}
    config = BenchConfig(data=str(musique_file), n=1, passages=2, ratios="0.5", methods="sink_aware",
                         blend_options=options, cold_examples=0, **FAST)
    document = run_benchmark(config, engine=engine)
    assert document["blend_config"]["sink_tokens"] == 2 and document["blend_config"]["mask"] == "bottom_right"
    with pytest.raises(ConfigError, match="not BlendConfig fields"):
        BenchConfig(data=str(musique_file), blend_options={"recompute_ratio": 0.2})
    with pytest.raises(ConfigError, match="FIELD=VALUE"):
        parse_blend_options(["sink_tokens"])


def test_prefix_caching_request_reproduces_full_prefill(engine):
    import torch

    from cacheblend_rag.bench.requests import FullPrefillRequest, PrefixCachingRequest

    ids = engine.tokenize("Paris is the capital of France. The quick brown fox jumps over the lazy dog.")
    full = engine.full_prefill(ids)
    prefix = FullPrefillRequest(engine, ids[:7]).prefill()
    request = PrefixCachingRequest(engine, ids, 7, prefix)
    out = request.prefill()
    assert torch.allclose(out.logits, full.logits, atol=1e-4)
    assert out.cache.get_seq_length() == len(ids)
    for layer in range(engine.num_layers):
        assert torch.allclose(out.cache.layers[layer].keys, full.cache.layers[layer].keys, atol=1e-4)
        assert torch.allclose(out.cache.layers[layer].values, full.cache.layers[layer].values, atol=1e-4)
    # The model's own forward (used without an adapter) agrees, and neither touches the shared prefix.
    fallback_logits, _ = request._model_forward(prefix.cache)
    assert torch.allclose(fallback_logits, full.logits, atol=1e-4)
    assert prefix.cache.get_seq_length() == 7
    cold = PrefixCachingRequest(engine, ids, 7, None).prefill()
    assert torch.allclose(cold.logits, full.logits, atol=1e-4)


def test_restrict_document_keeps_a_methods_corrections(engine, musique_file):
    # The probe and key corrections live only in a method's name; summarised again, a document must
    # still find their pairs (they came back empty under the plain method's name).
    from cacheblend_rag.bench.summary import restrict_document

    config = BenchConfig(data=str(musique_file), passages=3, ratios="0.5",
                         methods="full_reuse,cacheblend+probeshift4,cacheblend+keyshift0.5", **FAST)
    document = run_benchmark(config, engine=engine)
    again = restrict_document(json.loads(json.dumps(document)), [e["index"] for e in document["examples"]])
    assert [m["name"] for m in again["methods"]] == [m["name"] for m in document["methods"]]
    assert [m["quality"] for m in again["methods"]] == [m["quality"] for m in document["methods"]]


def test_conditioned_full_reuse_gets_a_recovery_interval_plain_full_reuse_none():
    from cacheblend_rag.bench.summary import _quality
    from cacheblend_rag.bench.methods import parse_methods

    kl = {"full_reuse": {0: 0.4, 1: 0.6, 2: 0.2}, "full_reuse+prefix": {0: 0.1, 1: 0.5, 2: 0.1}}
    for name, expected in (("full_reuse", None), ("full_reuse+prefix", True)):
        (spec,) = parse_methods(name, ratios=())
        quality = _quality(spec, lambda attr, _n=name: kl[_n] if attr == "kl" else {}, {}, kl["full_reuse"])
        if expected is None:
            assert quality["recovery"] == 0.0 and quality["recovery_ci95"] is None
        else:
            low, high = quality["recovery_ci95"]
            assert quality["recovery"] == pytest.approx(1 - 0.7 / 1.2)
            assert low <= quality["recovery"] <= high
