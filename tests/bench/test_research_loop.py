"""The research loop: full prefill's references cached on disk, chunk KV in a persistent store,
``--resume`` from the run's own JSON, and the diagnostics; tiny model, two tiny questions."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from cacheblend_rag.bench import BenchConfig, run_benchmark
from cacheblend_rag.bench.references import Reference, ReferenceCache, reference_key
from cacheblend_rag.errors import ConfigError

# No cold or throughput passes and one TTFT run: every engine call is one (question, method) pair.
LEAN = dict(max_new_tokens=4, teacher_tokens=4, throughput_new_tokens=4, throughput_requests=0, cold_examples=0,
            repeats=1, show_progress=False)


def by_name(document):
    return {m["name"]: m for m in document["methods"]}


@pytest.fixture
def counted(engine, monkeypatch):
    """The engine, counting its full prefills, blends and chunk precomputes."""
    calls = {"full_prefill": 0, "blend": 0, "prefill_chunks": 0}
    for name in calls:
        original = getattr(engine, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(engine, name, counting)
    engine.calls = calls
    yield engine
    del engine.calls


def _reference(vocab=11, kv=True):
    torch.manual_seed(0)
    return Reference(answer_ids=[3, 4], stopped_by=2, text="Paris", teacher_ids=[3, 4, 2],
                     teacher_logits=torch.randn(3, vocab),
                     kv=[(torch.randn(2, 5, 4), torch.randn(2, 5, 4)) for _ in range(3)] if kv else None)


# ------------------------------------------------------------------ reference cache
def test_reference_cache_round_trip_and_misses(tmp_path):
    cache = ReferenceCache(tmp_path)
    ids = [1, 2, 3, 4, 5]
    settings = dict(max_new_tokens=8, teacher_tokens=4)
    ref = _reference()
    assert cache.get("model-a", ids, **settings) is None
    cache.put("model-a", ids, ref, **settings)
    got = cache.get("model-a", ids, need_kv=True, kv_shape=(3, 2, 4), **settings)
    assert got is not None and got.text == "Paris" and got.stopped_by == 2
    assert got.answer_ids == [3, 4] and got.teacher_ids == [3, 4, 2]
    assert torch.equal(got.teacher_logits, ref.teacher_logits) and got.teacher_logits.dtype == torch.float32
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got.kv, ref.kv))
    # Another model, another prompt, other decoding settings: other keys.
    assert cache.get("model-b", ids, **settings) is None
    assert cache.get("model-a", ids[:-1], **settings) is None
    assert cache.get("model-a", ids, max_new_tokens=8, teacher_tokens=3) is None
    assert reference_key("m", [1, 2], max_new_tokens=8, teacher_tokens=4) != \
        reference_key("m", [1, 2], max_new_tokens=9, teacher_tokens=4)
    # Stored without K/V: a reader that needs them misses, one that does not hits.
    cache.put("model-a", [9, 9], _reference(kv=False), **settings)
    assert cache.get("model-a", [9, 9], need_kv=True, **settings) is None
    assert cache.get("model-a", [9, 9], **settings) is not None
    # The wrong model shape for the K/V is damage, not a match.
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert cache.get("model-a", ids, need_kv=True, kv_shape=(4, 2, 4), **settings) is None


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_reference_is_reported_removed_and_recomputed(tmp_path, damage):
    cache = ReferenceCache(tmp_path)
    settings = dict(max_new_tokens=8, teacher_tokens=4)
    path = cache.put("model-a", [1, 2, 3], _reference(kv=False), **settings)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40  # inside the last tensor's bytes: only the checksum notices
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=rf"reference cache entry {path}.*corrupt"):
        assert cache.get("model-a", [1, 2, 3], **settings) is None
    assert not path.exists() and cache.corrupt == 1
    cache.put("model-a", [1, 2, 3], _reference(kv=False), **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get("model-a", [1, 2, 3], **settings) is not None


def test_harness_reuses_cached_references(counted, musique_file, tmp_path):
    config = BenchConfig(data=str(musique_file), passages=2, ratios="0.5", methods="cacheblend",
                         reference_cache=str(tmp_path / "refs"), **LEAN)
    first = run_benchmark(config, engine=counted)
    first_calls = counted.calls["full_prefill"]
    assert first["work"]["full_prefill_runs"] == 2 and first["work"]["references_from_cache"] == 0
    second = run_benchmark(config, engine=counted)
    assert counted.calls["full_prefill"] - first_calls == 1  # the untimed warm-up alone: no question's prefill
    assert second["work"]["full_prefill_runs"] == 0 and second["work"]["references_from_cache"] == 2
    full = by_name(second)["full_prefill"]
    # Not measured, and said so: no TTFT, no speedup, while quality is the same.
    assert full["ttft_measured"] == 0 and full["ttft_s"]["median"] is None and full["ttft_speedup"] is None
    assert by_name(second)["cacheblend@0.5"]["ttft_speedup"] is None
    assert all(e["methods"]["full_prefill"]["ttft_s"] is None for e in second["examples"])
    for name in ("full_prefill", "full_reuse", "cacheblend@0.5"):
        assert by_name(second)[name]["quality"]["kl"] == pytest.approx(by_name(first)[name]["quality"]["kl"], abs=1e-6)
    timed = run_benchmark(BenchConfig(**{**config.__dict__, "time_full_prefill": True}), engine=counted)
    assert by_name(timed)["full_prefill"]["ttft_measured"] == 2 and by_name(timed)["cacheblend@0.5"]["ttft_speedup"] > 0


def test_persistent_store_computes_no_chunk_on_a_rerun(counted, musique_file, tmp_path):
    config = BenchConfig(data=str(musique_file), passages=2, ratios="0.5", methods="cacheblend,cacheblend+prefix",
                         store="disk", store_path=str(tmp_path / "kv"), **LEAN)
    first = run_benchmark(config, engine=counted)
    assert first["work"]["chunks_computed"] > 0
    assert all(set(e["precompute_s"]) == {"plain", "prefix"} for e in first["examples"])
    second = run_benchmark(config, engine=counted)
    assert second["work"]["chunks_computed"] == 0 and second["work"]["chunks_from_store"] == 2 * 2 * 2  # questions x variants x passages
    for example in second["examples"]:
        assert example["precompute_s"] == {} and example["chunks_from_store"] == {"plain": 2, "prefix": 2}
        assert all(m["stats"].get("cache_misses") == 0 for n, m in example["methods"].items() if n != "full_prefill")
    assert by_name(second)["cacheblend@0.5"]["precompute"]["ms_per_chunk"] is None
    assert (tmp_path / "kv" / "auto").is_dir()


# -------------------------------------------------------------------------- resume
def test_resume_runs_only_the_missing_pairs(counted, musique_file, tmp_path):
    refs = str(tmp_path / "refs")
    one = run_benchmark(BenchConfig(data=str(musique_file), n=1, passages=2, ratios="0.5", methods="full_reuse",
                                    reference_cache=refs, **LEAN), engine=counted)
    blends = counted.calls["blend"]
    grown = run_benchmark(BenchConfig(data=str(musique_file), n=2, passages=2, ratios="0.5",
                                      methods="full_reuse,cacheblend", reference_cache=refs, **LEAN),
                          engine=counted, resume=json.loads(json.dumps(one)))
    # Warm-up: one blend per chunk method. Question 0: cacheblend only. Question 1: both.
    assert counted.calls["blend"] - blends == 2 + 1 + 2
    assert grown["work"]["pairs_kept"] == 2 and grown["work"]["pairs_run"] == 1 + 3
    assert grown["work"]["full_prefill_runs"] == 1  # question 0's reference came from the cache
    assert not grown["partial"] and [len(e["methods"]) for e in grown["examples"]] == [3, 3]
    kept = grown["examples"][0]["methods"]["full_reuse"]
    assert kept == one["examples"][0]["methods"]["full_reuse"]  # carried over as it was
    assert grown["history"][0]["created_utc"] == one["created_utc"]
    # Nothing left to do: no engine call at all, not even the warm-up.
    calls = dict(counted.calls)
    again = run_benchmark(BenchConfig(data=str(musique_file), n=2, passages=2, ratios="0.5",
                                      methods="full_reuse,cacheblend", reference_cache=refs, **LEAN),
                          engine=counted, resume=grown)
    assert counted.calls == calls and again["work"]["pairs_run"] == 0
    assert [m["quality"] for m in again["methods"]] == [m["quality"] for m in grown["methods"]]


def test_a_resumed_run_stopped_midway_keeps_the_questions_it_did_not_reach(engine, musique_file):
    config = dict(data=str(musique_file), n=2, passages=2, ratios="0.5", **LEAN)
    done = run_benchmark(BenchConfig(methods="full_reuse", **config), engine=engine)
    written = []

    def stop_after_the_first_write(document):
        written.append(json.loads(json.dumps(document)))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_benchmark(BenchConfig(methods="full_reuse,cacheblend", **config), engine=engine,
                      on_partial=stop_after_the_first_write, resume=json.loads(json.dumps(done)))
    (stopped,) = written
    assert stopped["partial"] and [e["index"] for e in stopped["examples"]] == [0, 1]
    # Question 1 is not reached: as it was, waiting for its new method.
    assert stopped["examples"][1]["methods"] == done["examples"][1]["methods"]
    assert set(stopped["examples"][0]["methods"]) == {"full_prefill", "full_reuse", "cacheblend@0.5"}


def test_resume_refuses_other_settings(engine, musique_file):
    config = BenchConfig(data=str(musique_file), n=1, passages=2, methods="full_prefill", **LEAN)
    done = run_benchmark(config, engine=engine)
    with pytest.raises(ConfigError, match=r"--resume: teacher_tokens differs \(the result: 4, this run: 3\)"):
        run_benchmark(BenchConfig(**{**config.__dict__, "teacher_tokens": 3}), engine=engine, resume=done)
    with pytest.raises(ConfigError, match="passages differs"):
        run_benchmark(BenchConfig(**{**config.__dict__, "passages": 3}), engine=engine, resume=done)
    other_model = {**done, "model": {**done["model"], "fingerprint": "another-model"}}
    with pytest.raises(ConfigError, match="model fingerprint differs"):
        run_benchmark(config, engine=engine, resume=other_model)
    other_method = {**done, "methods": [{**m, "selection": "another"} for m in done["methods"]]}
    with pytest.raises(ConfigError, match="method full_prefill: selection differs"):
        run_benchmark(config, engine=engine, resume=other_method)
    other_data = {**done, "data": {**done["data"], "sha256": "0" * 64}}
    with pytest.raises(ConfigError, match=r"data \(SHA-256\) differs"):
        run_benchmark(config, engine=engine, resume=other_data)


def test_cli_resume_keeps_a_backup_and_never_overwrites_a_damaged_file(engine, musique_file, tmp_path, capsys):
    from cacheblend_rag.cli import main

    model_dir = tmp_path / "tiny-model"
    engine.model.save_pretrained(model_dir)
    engine.tokenizer.save_pretrained(model_dir)
    out = tmp_path / "r.json"
    argv = ["bench", "--data", str(musique_file), "--model", str(model_dir), "--device", "cpu", "--n", "1",
            "--passages", "2", "--methods", "full_reuse", "--max-new-tokens", "4", "--teacher-tokens", "4",
            "--throughput-requests", "0", "--cold-examples", "0", "--no-progress", "--out", str(out),
            "--reference-cache", str(tmp_path / "refs"), "--store", f"disk:{tmp_path / 'kv'}"]
    assert main(argv) == 0
    assert main([*argv, "--resume", "--methods", "full_reuse,cacheblend", "--ratios", "0.5"]) == 0
    result = json.loads(out.read_text())
    assert [m["name"] for m in result["methods"]] == ["full_prefill", "full_reuse", "cacheblend@0.5"]
    assert result["work"]["pairs_kept"] == 2 and result["work"]["chunks_computed"] == 0
    backups = list(tmp_path.glob("r.json.*.bak"))
    assert backups and len(json.loads(backups[-1].read_text())["methods"]) == 2
    capsys.readouterr()
    out.write_text(out.read_text()[:-40])  # a damaged file
    damaged = out.read_text()
    assert main([*argv, "--resume"]) == 2
    assert "not a readable JSON document" in capsys.readouterr().err
    assert out.read_text() == damaged


# ---------------------------------------------------------------------- diagnostics
def test_diagnostics(engine, musique_file, tmp_path):
    config = BenchConfig(data=str(musique_file), n=1, passages=3, ratios="1.0", methods="cacheblend",
                         diagnostics=True, reference_cache=str(tmp_path / "refs"), **LEAN)
    document = run_benchmark(config, engine=engine)
    methods = document["examples"][0]["methods"]
    exact, reuse = methods["cacheblend@1"]["diagnostics"], methods["full_reuse"]["diagnostics"]
    layers = engine.num_layers
    for d in (exact, reuse):
        assert len(d["kl_by_position"]) == document["examples"][0]["reference_answer_tokens"]
        assert d["replay_logit_error"] < 1e-3  # the replayed question is the blend's own computation
        for name in ("stale", "recomputed", "exact_prefix", "fresh"):
            assert len(d["attention_share"][name]) == layers
        for layer in range(layers):
            assert sum(d["attention_share"][n][layer] for n in d["attention_share"]) == pytest.approx(1.0, abs=1e-4)
    # Ratio 1: everything recomputed, so nothing is stale and every K/V is full prefill's.
    assert exact["tokens"]["stale"] == 0 and exact["tokens"]["recomputed"] > 0
    assert all(x == 0.0 for x in exact["attention_share"]["stale"])
    assert all(x is None for x in exact["kv_distance"]["stale"]["k"])
    for name in ("recomputed", "fresh"):
        for kv in ("k", "v"):
            assert max(exact["kv_distance"][name][kv]) < 1e-4, (name, kv)
    assert max(exact["kl_by_position"]) < 1e-6
    # Full reuse: every passage token is stale from layer 0, the question reads them, and their K/V
    # drift from full prefill's past layer 0 (which depends on the token alone: there only the
    # 16-bit storage of a float32 model's chunks shows).
    assert reuse["first_stale_layer"] == 0 and reuse["tokens"]["recomputed"] == 0
    assert all(x > 0 for x in reuse["attention_share"]["stale"])
    assert reuse["kv_distance"]["stale"]["k"][0] < 1e-3 and reuse["kv_distance"]["stale"]["k"][-1] > 0.1
    assert sum(reuse["kl_by_position"]) > 0
    # A rerun with --diagnostics reads full prefill's K/V from the reference cache.
    again = run_benchmark(config, engine=engine)
    assert again["work"]["full_prefill_runs"] == 0
    assert again["examples"][0]["methods"]["full_reuse"]["diagnostics"]["kv_distance"] == reuse["kv_distance"]


def test_diagnostics_report_and_plots(engine, musique_file, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    from cacheblend_rag.bench.report import write_json

    config = BenchConfig(data=str(musique_file), passages=2, ratios="0.5", methods="prefix_caching,cacheblend",
                         diagnostics=True, **LEAN)
    out = write_json(run_benchmark(config, engine=engine), tmp_path / "diag.json")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_report.py"
    spec = importlib.util.spec_from_file_location("quality_report", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kv, kl = tmp_path / "kv.png", tmp_path / "kl.png"
    assert module.main([str(out), "--kv-plot", str(kv), "--kl-plot", str(kl)]) == 0
    table = capsys.readouterr().out
    assert "| method | questions | KL first position |" in table
    assert "| cacheblend@0.5 | 2 |" in table and "| prefix_caching | 2 |" in table
    for png in (kv, kl):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
