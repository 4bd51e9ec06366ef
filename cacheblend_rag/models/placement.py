"""Putting a loaded model on its device: float weights by ``.to()``, quantized ones by transformers.

Quantized weights (bitsandbytes, GPTQ, AWQ, ...; any model with a ``quantization_config``, or with
parameters that are not floating point) are laid out for the device their kernels run on, and
transformers refuses, or mishandles, moving them with ``.to()``. So a quantized load asks
transformers to place the weights on the requested device itself (``device_map``), and a model that
ends up quantized somewhere else is refused with an error that says where its weights are and what
to pass instead. A quantization that transformers cannot load on the device asked for (its kernels need a
GPU, or a library this machine lacks) is refused naming the quantization, the device and the float or GGUF
alternative. A GGUF is not quantized by this measure: transformers dequantises it to float at load.
"""

from __future__ import annotations

from typing import Any

import torch

from cacheblend_rag.errors import ConfigError, ModelLoadError

# transformers marks a model read from a GGUF with this quant_method, but its weights are plain floats.
DEQUANTISED_METHODS = frozenset({"gguf"})


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def describe_quantization(quantization_config: Any) -> str | None:
    """``quantization_config`` (a transformers config object or its dict) in words, as
    ``"bitsandbytes 4-bit"`` or ``"gptq 4-bit"``; ``None`` when there is none or it holds float weights (GGUF)."""
    if quantization_config is None:
        return None
    method = _field(quantization_config, "quant_method")
    method = str(getattr(method, "value", method) or "unknown method")
    if method.lower() in DEQUANTISED_METHODS:
        return None
    if _field(quantization_config, "load_in_4bit"):
        bits = 4
    elif _field(quantization_config, "load_in_8bit"):
        bits = 8
    else:
        bits = _field(quantization_config, "bits")
    return f"{method} {bits}-bit" if isinstance(bits, int) else method


def weights_quantization(model: torch.nn.Module) -> str | None:
    """Why ``model``'s weights are not plain floating point (its quantization method, or the dtypes of
    its non-float parameters, ``"int8 parameters"``); ``None`` for a float model."""
    config = getattr(model, "config", None)
    described = describe_quantization(getattr(config, "quantization_config", None))
    if described is None:
        quantizer = getattr(model, "hf_quantizer", None)
        described = describe_quantization(getattr(quantizer, "quantization_config", None))
    if described is not None:
        return described
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if not p.is_floating_point()})
    return f"{', '.join(dtypes)} parameters" if dtypes else None


def load_quantization(model_config: Any, model_kwargs: dict[str, Any]) -> str | None:
    """The quantization a load asks for, in words (a ``quantization_config`` in ``model_kwargs`` or in the
    checkpoint's config); ``None`` for a float load."""
    return describe_quantization(
        model_kwargs.get("quantization_config") or getattr(model_config, "quantization_config", None))


def quantized_load_placement(model_config: Any, model_kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Extra ``from_pretrained`` arguments for a load onto ``device``: ``device_map`` when the load is
    quantized (a ``quantization_config`` in ``model_kwargs`` or in the checkpoint's config), so that
    transformers places the weights there itself; nothing for a float load, which ``.to()`` moves."""
    if load_quantization(model_config, model_kwargs) is None:
        return {}
    return {"device_map": {"": str(device)}}


def unrunnable_quantization(quantization: str, device: torch.device, reason: BaseException) -> ConfigError:
    """The error for quantized weights that transformers cannot load on ``device`` (``reason``: its own
    refusal, e.g. no GPU for a GPTQ kernel, bitsandbytes not installed or built without this device),
    naming the quantization, the device and what to pass instead."""
    on_gpu = device.type == "cuda"
    elsewhere = ("install the kernels transformers names above for this GPU" if on_gpu
                 else "load these weights on a GPU (device='cuda') where their kernels run")
    return ConfigError(
        f"{quantization} weights cannot be loaded on {device}: transformers refuses ({type(reason).__name__}: "
        f"{reason}). Quantized weights run only where their kernels do; {elsewhere}, or load the model's float "
        "checkpoint (with dtype='bfloat16' or 'float16' for half the memory of float32) or its GGUF file "
        "(model='path/to/model.gguf', dequantised to float at load), which run on any device"
    )


def _on(actual: torch.device, wanted: torch.device) -> bool:
    if actual.type != wanted.type:
        return False
    if actual.type == "cuda" and wanted.index is None:  # "cuda": the current device
        return actual.index in (None, torch.cuda.current_device())
    return wanted.index is None or actual.index in (None, wanted.index)


def place_on_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` on ``device``, in eval mode: a float model moved there with ``.to()``; a quantized one
    left where transformers placed it if that is ``device``, else refused (:class:`ModelLoadError`)."""
    quantization = weights_quantization(model)
    if quantization is None:
        return model.to(device).eval()
    where = sorted({str(p.device) for p in model.parameters() if not _on(p.device, device)})
    if not where:
        return model.eval()
    on_gpu = all(w.startswith("cuda") for w in where)
    instead = (f"load them on the GPU with device={where[0]!r}" if on_gpu and len(where) == 1
               else f"load them with device={where[0]!r}, where their kernels put them" if len(where) == 1
               else "load them on one device")
    raise ModelLoadError(
        f"quantized weights ({quantization}) cannot be moved to {device}: they are on {', '.join(where)}, and "
        f"transformers does not move quantized weights with .to(); {instead}, or pass a float model (a GGUF or "
        "a float checkpoint, which load on any device)"
    )
