"""Calibrations across dtypes: a setting measured on a model in float32 reaches the same weights loaded in
bfloat16, and says so (its source, a warning once); an exact-dtype setting is preferred; a calibration of
the same model saved without its weights' identity is not used in another dtype, with a warning and a
source that say why; the shipped settings name their weights by the catalog's GGUF digest."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from cacheblend_rag import BlendConfig, CachedSegment, FreshSegment
from cacheblend_rag.calibration.measure import calibrate
from cacheblend_rag.bench.prompt import MusiqueExample, build_prompt
from cacheblend_rag.calibration import lookup as calibrated
from cacheblend_rag.calibration.lookup import parse_document
from cacheblend_rag.models.catalog import lookup
from cacheblend_rag.models.fingerprint import content_identity, record_weights_source
from cacheblend_rag.testing import tiny_engine

from calibration_fixtures import _own_calibration_dir  # noqa: F401 (an autouse fixture)

PASSAGES = [("France", "Paris is the capital of France. The quick brown fox jumps over the lazy dog."),
            ("Amazon", "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.")]


@pytest.fixture(scope="module")
def float32_engine():
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def measured(float32_engine):
    """A calibration of the tiny model in float32 (not saved: each test saves it where it wants)."""
    engine = float32_engine
    prompt = build_prompt(engine.tokenizer, MusiqueExample("Where is Paris?", [], PASSAGES), passages=2)
    return calibrate(engine, [prompt], "kv_deviation@0.5,kv_deviation@1.0", teacher_tokens=2, progress=False)


def test_a_calibration_records_its_dtype_and_weights(float32_engine, measured, tmp_path):
    document = json.loads(measured.save(tmp_path).read_text())
    assert document["dtype"] == "float32"
    assert document["weights"] == {"architecture": "llama", "hidden_size": 64, "num_hidden_layers": 4,
                                   "identities": [content_identity(float32_engine.model, float32_engine.tokenizer)]}


def test_a_float32_calibration_reaches_the_same_weights_in_bfloat16_and_says_so(float32_engine, measured, caplog):
    path = measured.save()
    engine = tiny_engine("llama", dtype=torch.bfloat16)
    assert engine.fingerprint != float32_engine.fingerprint  # it holds the dtype; the weights' identity does not
    with caplog.at_level(logging.WARNING):
        assert engine.config_source == f"calibrated (measured in float32): {path}"
        setting = engine.calibration()
    assert setting is not None and setting.dtype == "float32" and setting.measured_note == "measured in float32"
    assert engine.default_config() == BlendConfig().with_overrides(**measured.chosen.config)
    assert "was measured in float32, not in bfloat16" in caplog.text and "--dtype bfloat16" in caplog.text
    # Said once, not on every blend; the blend's stats carry the source.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ids = engine.tokenize(PASSAGES[0][1])
        stats = engine.blend([CachedSegment(engine.prefill_chunk(ids)), FreshSegment(ids[:4])]).stats
    assert stats.config_source == f"calibrated (measured in float32): {path}" and stats.dtype == "bfloat16"
    assert stats.blend_setting == measured.chosen.name and caplog.text == ""
    # The float32 engine itself still takes it as its own, and another model's bfloat16 load does not.
    assert float32_engine.config_source == f"calibrated: {path}"
    assert tiny_engine("llama", seed=1, dtype=torch.bfloat16).config_source == "built-in"


def test_the_integrations_say_it_too(measured, tmp_path):
    from llama_index.llms.cacheblend import CacheBlendLLM

    path = measured.save(tmp_path)
    llm = CacheBlendLLM.from_engine(tiny_engine("llama", dtype=torch.bfloat16), calibration_dir=str(tmp_path))
    assert llm.config_source == f"calibrated (measured in float32): {path}"
    assert llm.blend_config == BlendConfig(**measured.chosen.config)


def test_a_shipped_setting_reaches_another_dtype_and_an_exact_one_is_preferred(measured, tmp_path, monkeypatch):
    shipped_dir = tmp_path / "shipped"
    monkeypatch.setattr(calibrated, "SHIPPED_DIR", shipped_dir)
    shipped = measured.save(shipped_dir)
    engine = tiny_engine("llama", dtype=torch.bfloat16)
    assert engine.config_source == f"calibrated (shipped, measured in float32): {shipped}"
    # A calibration measured in bfloat16 itself wins over the float32 one, shipped or the user's.
    prompt = build_prompt(engine.tokenizer, MusiqueExample("Where is Paris?", [], PASSAGES), passages=2)
    own = calibrate(engine, [prompt], "kv_deviation@1.0", teacher_tokens=2, progress=False)
    assert json.loads(own.save().read_text())["dtype"] == "bfloat16"
    assert engine.config_source == f"calibrated: {calibrated.calibration_path(engine.fingerprint)}"
    assert engine.default_config().recompute_ratio == 1.0


def test_weights_loaded_from_a_gguf_are_known_by_its_digest(measured, tmp_path):
    document = copy.deepcopy(measured.to_document())
    document["weights"]["identities"] = ["gguf-sha256:" + "ab" * 32]  # as the shipped settings name theirs
    (tmp_path / "calibration").mkdir()
    path = tmp_path / "calibration" / "from-gguf.json"
    path.write_text(json.dumps(document))
    engine = tiny_engine("llama", dtype=torch.bfloat16)
    assert engine.config_source == "built-in"  # its content is the same, but the document names only the GGUF
    record_weights_source(engine.model, "gguf-sha256:" + "ab" * 32)  # what the loader does for a GGUF
    assert engine.config_source == f"calibrated (measured in float32): {path}"
    with torch.no_grad():
        engine.model.model.norm.weight.add_(1.0)  # weights changed since loaded: no longer the GGUF's
    assert engine.config_source == "built-in"


def test_an_old_calibration_without_weights_is_exact_only_and_another_dtype_is_warned(float32_engine, measured,
                                                                                        caplog):
    document = copy.deepcopy(measured.to_document())
    for added in ("dtype", "weights"):  # as saved before these were recorded
        document.pop(added)
    path = calibrated.save_calibration(document)
    assert float32_engine.config_source == f"calibrated: {path}"  # the same fingerprint: used as ever
    engine = tiny_engine("llama", dtype=torch.bfloat16)
    assert engine.model_name == float32_engine.model_name
    with caplog.at_level(logging.WARNING):
        source = engine.config_source
        assert engine.calibration() is None and engine.default_config() == BlendConfig()
    assert source.startswith("built-in (the calibration ") and "records no weights identity" in source
    assert caplog.text.count("no calibrated setting fits") == 1
    ids = engine.tokenize(PASSAGES[0][1])
    assert engine.blend([CachedSegment(engine.prefill_chunk(ids)), FreshSegment(ids[:4])]).stats.config_source == source


def test_a_document_naming_no_model_is_reported_not_matched(measured, tmp_path, caplog):
    document = copy.deepcopy(measured.to_document())
    document.pop("fingerprint")
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "nameless.json").write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING):
        assert tiny_engine("llama", dtype=torch.bfloat16).config_source == "built-in"
    assert "names no model" in caplog.text


def test_every_shipped_setting_names_its_dtype_and_its_models_gguf():
    for path in sorted(calibrated.SHIPPED_DIR.glob("*.json")):
        setting = parse_document(json.loads(path.read_text()), path.stem, str(path), shipped=True)
        model = lookup(setting.model)
        assert setting.dtype in ("float32", "bfloat16", "float16"), f"{path}: no dtype recorded"
        assert f"gguf-sha256:{model.sha256}" in setting.identities, f"{path}: not keyed to {model.filename}"
        assert setting.shape["architecture"] and setting.shape["hidden_size"] and setting.shape["num_hidden_layers"]


def test_the_quality_model_ships_its_setting_in_both_dtypes_a_cpu_picks():
    """Qwen2.5-Coder-1.5B's setting was measured in float32 and again in bfloat16 (issue 55): one document each, the
    same setting, the same GGUF; a bfloat16 load finds its own, not the float32 one (the source says no other dtype)."""
    documents = [json.loads(path.read_text()) for path in sorted(calibrated.SHIPPED_DIR.glob("*.json"))]
    quality = {d["dtype"]: d for d in documents if d["model"] == "qwen2.5-coder-1.5b"}
    assert set(quality) == {"float32", "bfloat16"}
    assert quality["float32"]["chosen"]["config"] == quality["bfloat16"]["chosen"]["config"]
    assert quality["float32"]["fingerprint"] != quality["bfloat16"]["fingerprint"]  # the fingerprint holds the dtype
    assert quality["float32"]["weights"]["identities"][0] in quality["bfloat16"]["weights"]["identities"]


@pytest.mark.slow
def test_smollm2_in_bfloat16_finds_a_float32_setting_of_its_gguf(tmp_path):
    """The quality model's case, on the embedded model: a setting measured in float32 and named by the GGUF's
    digest (as the shipped one is) reaches the model loaded from that GGUF in bfloat16."""
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.models import loader

    digest = loader.converted_gguf_folder(loader.default_gguf_path())[1]
    document = {"format": calibrated.FORMAT, "version": calibrated.VERSION, "fingerprint": "0" * 64,
                "model": loader.DEFAULT_MODEL_NAME, "dtype": "float32",
                "weights": {"architecture": "llama", "hidden_size": 576, "num_hidden_layers": 30,
                            "identities": [f"gguf-sha256:{digest}"]},
                "chosen": {"config": {"recompute_ratio": 0.3, "selection": "kv_deviation"}, "condition_chunks": False}}
    path = calibrated.write_json_atomically(tmp_path / "calibration" / "smollm2-float32.json", document)
    engine = CacheBlendEngine.from_pretrained(dtype="bfloat16")
    assert engine.dtype == torch.bfloat16 and engine.dtype_reason == "explicit: bfloat16"
    assert engine.config_source == f"calibrated (measured in float32): {path}"
    assert engine.default_config().recompute_ratio == 0.3
