"""Quantized weights are placed by transformers, never moved with ``.to()`` (no bitsandbytes needed here)."""

from __future__ import annotations

import json

import pytest
import torch

from cacheblend_rag import ModelLoadError, load_model
from cacheblend_rag.models.placement import (
    describe_quantization, place_on_device, quantized_load_placement, weights_quantization,
)
from cacheblend_rag.testing import tiny_model, tiny_tokenizer

BNB_4BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False}
CPU = torch.device("cpu")


def refuse_to(model: torch.nn.Module) -> torch.nn.Module:
    def to(*args, **kwargs):
        raise AssertionError(".to() called on quantized weights")

    model.to = to
    return model


def test_quantization_in_words():
    assert describe_quantization(BNB_4BIT) == "bitsandbytes 4-bit"
    assert describe_quantization({"quant_method": "bitsandbytes", "load_in_8bit": True}) == "bitsandbytes 8-bit"
    assert describe_quantization({"quant_method": "gptq", "bits": 4}) == "gptq 4-bit"
    assert describe_quantization({"quant_method": "gguf"}) is None  # dequantised to float at load
    assert describe_quantization(None) is None


def test_a_float_model_is_moved_with_to():
    model = tiny_model("llama").train()
    assert weights_quantization(model) is None
    placed = place_on_device(model, CPU)
    assert placed is model and not placed.training


def test_quantized_weights_already_on_the_device_stay_where_they_are():
    model = tiny_model("llama").train()
    model.config.quantization_config = BNB_4BIT
    assert weights_quantization(model) == "bitsandbytes 4-bit"
    placed = place_on_device(refuse_to(model), CPU)
    assert placed is model and not placed.training


def test_integer_parameters_count_as_quantized():
    model = tiny_model("llama")
    model.model.layers[0].mlp.register_parameter(
        "packed", torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False))
    assert weights_quantization(model) == "int8 parameters"
    assert place_on_device(refuse_to(model), CPU) is model


def test_quantized_weights_elsewhere_are_refused_with_the_fix():
    with torch.device("meta"):  # weights on another device than the one asked for, without a GPU
        model = tiny_model("llama")
    model.config.quantization_config = BNB_4BIT
    with pytest.raises(ModelLoadError, match=r"quantized weights \(bitsandbytes 4-bit\) cannot be moved to cpu: "
                                             r"they are on meta.*device='meta'.*or pass a float model"):
        place_on_device(refuse_to(model), CPU)


def test_a_quantized_load_asks_transformers_to_place_it():
    assert quantized_load_placement(None, {"quantization_config": BNB_4BIT}, CPU) == {"device_map": {"": "cpu"}}
    config = tiny_model("llama").config
    assert quantized_load_placement(config, {}, CPU) == {}
    config.quantization_config = {"quant_method": "gguf"}
    assert quantized_load_placement(config, {}, CPU) == {}


@pytest.mark.parametrize("where", ["checkpoint", "model_kwargs"])
def test_load_model_places_quantized_weights_instead_of_moving_them(where, tmp_path, monkeypatch):
    import transformers

    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    if where == "checkpoint":  # a pre-quantized checkpoint: its config.json says so
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": BNB_4BIT}))
    asked = {}

    def from_pretrained(target, **kwargs):  # what transformers with bitsandbytes would return, placed on the device
        asked.update(kwargs)
        model = tiny_model("llama", vocab_size=len(tokenizer))
        model.config.quantization_config = BNB_4BIT
        return refuse_to(model)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    options = {"quantization_config": BNB_4BIT} if where == "model_kwargs" else {}
    loaded = load_model(tmp_path, device="cpu", dtype="float32", model_kwargs=options)
    assert asked["device_map"] == {"": "cpu"}
    assert weights_quantization(loaded.model) == "bitsandbytes 4-bit" and loaded.adapter is not None


@pytest.mark.parametrize(("refusal", "device", "advice"), [
    # What transformers' quantizers raise where the kernels cannot run (no bitsandbytes here: stubbed).
    (ImportError("Using `bitsandbytes` 4-bit quantization requires bitsandbytes: `pip install -U bitsandbytes>=0.46.1`"),
     "cpu", "load these weights on a GPU \\(device='cuda'\\)"),
    (RuntimeError("GPU is required to quantize or run quantize model."), "cpu", "on a GPU"),
    (ValueError("Some modules are dispatched on the CPU or the disk."), "cpu", "on a GPU"),
])
def test_quantized_weights_the_device_cannot_run_are_refused_naming_what_to_do(
        refusal, device, advice, tmp_path, monkeypatch):
    import transformers

    from cacheblend_rag import ConfigError

    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": BNB_4BIT}))

    def from_pretrained(target, **kwargs):
        raise refusal

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(ConfigError, match=rf"bitsandbytes 4-bit weights cannot be loaded on {device}: transformers "
                                          rf"refuses \({type(refusal).__name__}: .*{advice}.*float checkpoint.*GGUF"):
        load_model(tmp_path, device=device, dtype="float32")


def test_a_float_load_keeps_transformers_own_error(tmp_path, monkeypatch):
    import transformers

    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    def from_pretrained(target, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(RuntimeError, match="^out of memory$"):
        load_model(tmp_path, device="cpu", dtype="float32")
