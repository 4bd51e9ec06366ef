"""Calibrations per device type: a calibration records the device type it was measured on, one model keeps a file
per device type, and the engine prefers its own device type's setting (its fingerprint's, then its weights' in
another dtype) to another device type's, which it uses only failing those and says so (source, a warning once).
A document from before devices were recorded counts as measured on a CPU. No GPU is needed: the documents
say which device type they were measured on, and an engine's device type is what the lookup reads."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from cacheblend_rag import CachedSegment, FreshSegment
from cacheblend_rag.calibration.measure import calibrate
from cacheblend_rag.calibration.state import default_state_path
from cacheblend_rag.bench.prompt import MusiqueExample, build_prompt
from cacheblend_rag.calibration import lookup as calibrated
from cacheblend_rag.calibration.lookup import CALIBRATION_DIR_ENV, calibration_path, load_calibration
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import tiny_engine

PASSAGES = [("France", "Paris is the capital of France. The quick brown fox jumps over the lazy dog."),
            ("Amazon", "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.")]


@pytest.fixture(autouse=True)
def _own_calibration_dir(tmp_path, monkeypatch):
    # Never the user's ~/.cache (nor the shipped settings): a test's engine finds only what the test saves.
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(tmp_path / "calibration"))
    monkeypatch.setattr(calibrated, "SHIPPED_DIR", tmp_path / "shipped")


@pytest.fixture(scope="module")
def document():
    """A calibration of the tiny model in float32 on this CPU, as saved."""
    engine = tiny_engine("llama")
    prompt = build_prompt(engine.tokenizer, MusiqueExample("Where is Paris?", [], PASSAGES), passages=2)
    return calibrate(engine, [prompt], "kv_deviation@0.5", teacher_tokens=2, progress=False).to_document()


def variant(document: dict, *, ratio: float, device: str | None, engine=None) -> dict:
    """``document`` with another chosen ratio (to tell the settings apart), measured on ``device`` (None: a
    document from before devices were recorded), and for ``engine``'s fingerprint and dtype when given."""
    changed = copy.deepcopy(document)
    changed["chosen"]["config"]["recompute_ratio"] = ratio
    changed.pop("device", None)
    if device is not None:
        changed["device"] = device
    if engine is not None:
        changed["fingerprint"], changed["dtype"] = engine.fingerprint, str(engine.dtype).removeprefix("torch.")
    return changed


def on_device(engine, device: str):
    """``engine`` as the lookup sees an engine on ``device`` (its blends would still run where its weights are)."""
    engine.device = torch.device(device)
    return engine


def test_a_calibration_records_its_device_type_and_each_device_type_has_its_file(document, tmp_path):
    assert document["device"] == "cpu"
    engine = tiny_engine("llama")
    cpu = calibrated.save_calibration(document)
    gpu = calibrated.save_calibration(variant(document, ratio=1.0, device="cuda"))
    assert cpu == calibration_path(engine.fingerprint) == calibration_path(engine.fingerprint, device="cpu")
    assert gpu == calibration_path(engine.fingerprint, device="cuda") and gpu.name.endswith(".cuda.json")
    assert cpu.exists() and gpu.exists()  # side by side: a GPU calibration does not replace the CPU one
    assert load_calibration(engine.fingerprint, device="cuda").device == "cuda"
    # The CPU engine keeps the CPU setting, the same weights on a GPU take the GPU's; the stats say whose.
    assert engine.config_source == f"calibrated: {cpu}" and engine.default_config().recompute_ratio == 0.5
    ids = engine.tokenize(PASSAGES[0][1])
    stats = engine.blend([CachedSegment(engine.prefill_chunk(ids)), FreshSegment(ids[:4])]).stats
    assert stats.device == "cpu" and stats.to_dict()["device"] == "cpu" and stats.config_source == f"calibrated: {cpu}"
    gpu_engine = on_device(tiny_engine("llama"), "cuda")
    assert gpu_engine.config_source == f"calibrated: {gpu}" and gpu_engine.default_config().recompute_ratio == 1.0
    # A run's measurements go beside its result, one state file per device type too.
    assert default_state_path(engine.fingerprint, tmp_path) == tmp_path / f"{engine.fingerprint}.state.json"
    assert default_state_path(engine.fingerprint, tmp_path, "cuda").name == f"{engine.fingerprint}.cuda.state.json"


def test_the_engines_own_device_type_comes_first_then_another_device_types(document, caplog):
    float32 = tiny_engine("llama")
    engine = tiny_engine("llama", dtype=torch.bfloat16)  # on a CPU
    saved = {
        "exact here": calibrated.save_calibration(variant(document, ratio=0.1, device="cpu", engine=engine)),
        "other dtype here": calibrated.write_json_atomically(
            calibrated.calibration_dir() / "float32-cpu.json", variant(document, ratio=0.2, device="cpu")),
        "exact elsewhere": calibrated.save_calibration(variant(document, ratio=0.3, device="cuda", engine=engine)),
        "other dtype elsewhere": calibrated.save_calibration(variant(document, ratio=0.4, device="cuda")),
    }
    assert saved["other dtype elsewhere"] == calibration_path(float32.fingerprint, device="cuda")
    expected = [("exact here", "calibrated: {}", 0.1),
                ("other dtype here", "calibrated (measured in float32): {}", 0.2),
                ("exact elsewhere", "calibrated (measured on cuda in bfloat16): {}", 0.3),
                ("other dtype elsewhere", "calibrated (measured on cuda in float32): {}", 0.4)]
    for name, source, ratio in expected:  # each found while those before it are there, then taken away
        with caplog.at_level(logging.WARNING):
            assert engine.config_source == source.format(saved[name])
            assert engine.default_config().recompute_ratio == ratio
        saved[name].unlink()
    assert engine.config_source == "built-in"
    # Another device type's setting is said once each, with the command that measures one here.
    warned = [r.getMessage() for r in caplog.records if "not on cpu" in r.getMessage()]
    assert len(warned) == 2 and all("calibrate --device cpu --dtype bfloat16 --cost ttft" in w for w in warned)
    assert "was measured on cuda in bfloat16, not on cpu" in warned[0]


def test_an_old_calibration_counts_as_measured_on_a_cpu(document, caplog):
    legacy = variant(document, ratio=0.3, device=None)
    path = calibrated.save_calibration(legacy)
    assert path.name == f"{legacy['fingerprint']}.json"  # the name it always had
    cpu = tiny_engine("llama")
    assert cpu.config_source == f"calibrated: {path}" and cpu.calibration().device == "cpu"
    # On a GPU it is still the best there is, and said to be a CPU's; the stats carry it.
    gpu = on_device(tiny_engine("llama"), "cuda")
    with caplog.at_level(logging.WARNING):
        assert gpu.config_source == f"calibrated (measured on cpu in float32): {path}"
        assert gpu.default_config().recompute_ratio == 0.3
    assert caplog.text.count("not on cuda") == 1 and "--device cuda --dtype float32 --cost ttft" in caplog.text
    # A calibration measured on the GPU then takes over there, and the CPU keeps its own.
    mine = calibrated.save_calibration(variant(document, ratio=0.5, device="cuda"))
    assert gpu.config_source == f"calibrated: {mine}" and cpu.config_source == f"calibrated: {path}"


def test_a_device_that_is_no_device_type_is_refused(document, caplog):
    engine = tiny_engine("llama")
    bad = variant(document, ratio=0.3, device="cuda:0")
    with pytest.raises(ConfigError, match="not a device type.*\"cuda\", not \"cuda:0\""):
        calibrated.save_calibration(bad)
    path = calibrated.write_json_atomically(calibration_path(engine.fingerprint), bad)
    with caplog.at_level(logging.WARNING):
        assert engine.config_source == "built-in"
    assert "ignoring the calibration result" in caplog.text and "not a device type" in caplog.text
    assert json.loads(path.read_text())["device"] == "cuda:0"  # reported, never rewritten
    with pytest.raises(ConfigError, match="device"):
        calibration_path(engine.fingerprint, device="../cuda")
