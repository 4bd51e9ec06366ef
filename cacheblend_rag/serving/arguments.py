"""The arguments :class:`~cacheblend_rag.serving.settings.CacheBlendSettings` takes, checked and read
before pydantic sees them: which names are fields (an unknown one is an error naming the closest known
one), the BlendConfig and sampling fields checked as the user wrote them, and the Hugging Face
integrations' spellings (``model_id``, ``torch_dtype``, ``device_map``, ``generate_kwargs``...) turned
into these fields, or refused with what to pass instead.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import fields
from typing import Any, Optional

import torch

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.models.loader import resolve_device

# Every BlendConfig field is exposed, under its own name; calls may override them too.
BLEND_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(BlendConfig))

# The sampling fields both expose; the answer's length is each framework's own (max_new_tokens, max_tokens).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "min_new_tokens")


# Other libraries' names for a setting, and ours, in the order tried: the closest spelling would mislead
# (max_new_tokens is closest to min_new_tokens). Each integration has one of the length names.
_NAMES_ELSEWHERE: dict[str, tuple[str, ...]] = {
    "max_new_tokens": ("max_tokens",),
    "max_tokens": ("max_new_tokens",),
    "max_output_tokens": ("max_tokens", "max_new_tokens"),
    "num_predict": ("max_tokens", "max_new_tokens"),
    "stop_sequences": ("stop",),
    "stop_words": ("stop",),
}

# Names refused with a reason rather than a spelling.
_EXPLAINED = {
    "trust_remote_code": "the embedded, catalog and GGUF models run no remote code; for a hub model whose "
    "architecture needs it pass model_kwargs={'trust_remote_code': True} (a blend also needs an architecture "
    "cacheblend_rag supports, else fallback_to_full_prefill=True serves it with full prefill)",
}


def unknown_names_error(owner: str, unknown: list[str], allowed: set[str], what: str = "argument") -> ValueError:
    """``owner got unknown argument(s) 'x' (did you mean 'y'?)``: another library's name for a setting
    gets ours, a name with no equivalent the reason, any other the closest known spelling."""
    hints = []
    for name in unknown:
        if name in _EXPLAINED:
            hints.append(f"{name!r} ({_EXPLAINED[name]})")
            continue
        ours = [n for n in _NAMES_ELSEWHERE.get(name, ()) if n in allowed][:1]
        close = ours or difflib.get_close_matches(name, sorted(allowed), 1)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return ValueError(f"{owner} got unknown {what}(s) {', '.join(hints)}")


def checked_as_given(values: dict[str, Any]) -> None:
    """Check the BlendConfig and sampling fields as the user wrote them, before pydantic coerces them
    (``recompute_ratio="0.15"`` would become 0.15): one validation, BlendConfig's and
    GenerationConfig's, whatever the entry point. Raises their ConfigError (a ValueError)."""
    blend = {name: values[name] for name in BLEND_FIELDS if name in values}
    if blend:
        BlendConfig(**blend)
    sampling = {name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None}
    if sampling:
        # The answer's length is checked against min_new_tokens per call, where both are known.
        GenerationConfig(max_new_tokens=max(1, int(sampling.get("min_new_tokens") or 0)), **sampling)


_GENERATE_KWARGS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample",
                    "seed", "min_new_tokens"}


def hugging_face_spellings(owner: str, values: dict[str, Any], max_tokens_field: str,
                           logger: logging.Logger) -> dict[str, Any]:
    """``HuggingFaceLLM``/``ChatHuggingFace`` arguments as this package's fields: ``model_name`` and
    ``model_id`` are ``model``, ``torch_dtype`` is ``dtype``, a one-device ``device_map`` is ``device``,
    ``generate_kwargs``/``pipeline_kwargs`` are the sampling fields. What cannot be honoured is an error
    saying what to use. The device ``device_map="auto"`` maps to is said in ``logger`` (the caller's)."""
    for alias in ("model_name", "model_id"):
        if alias in values:
            name = values.pop(alias)
            if values.get("model") not in (None, name):
                raise ValueError(f"{owner} got model={values['model']!r} and {alias}={name!r}; pass only model=")
            values["model"] = name
    if "torch_dtype" in values:
        dtype = values.pop("torch_dtype")
        values.setdefault("dtype", str(dtype).removeprefix("torch.") if dtype is not None else None)
    if "device_map" in values:
        values.setdefault("device", _one_device(owner, values.pop("device_map"), logger))
    for option in ("generate_kwargs", "pipeline_kwargs"):
        given = values.pop(option, None) or {}
        unknown = sorted(set(given) - _GENERATE_KWARGS)
        if unknown:
            raise ValueError(f"{owner} cannot honour {option} {unknown}: it supports {sorted(_GENERATE_KWARGS)} "
                             "(as the fields of the same names)")
        given = dict(given)
        if given.pop("do_sample", None) is False:
            given.setdefault("temperature", 0.0)
        if "max_new_tokens" in given:
            values.setdefault(max_tokens_field, given.pop("max_new_tokens"))
        for name, value in given.items():
            values.setdefault(name, value)
    return values


def _one_device(owner: str, device_map: Any, logger: logging.Logger) -> Optional[str]:
    """The one device a ``device_map`` names (``"auto"``: the best one here, said in the log)."""
    if device_map is None:
        return None
    if device_map == "auto":
        return _auto_device(owner, logger)
    if isinstance(device_map, dict) and len(set(device_map.values())) == 1:
        device_map = next(iter(device_map.values()))
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return f"cuda:{device_map}"
    if isinstance(device_map, str) and device_map not in ("balanced", "balanced_low_0", "sequential"):
        return device_map
    raise ValueError(f"{owner} got device_map={device_map!r}: a blend runs the whole model on one device; pass "
                     "device='cuda:0' (or 'cpu'), or device_map='auto' for the best one here")


def _auto_device(owner: str, logger: logging.Logger) -> str:
    """``device_map="auto"`` as the one device it maps to here; with several GPUs Hugging Face would split the
    model over them, and a blend cannot, so that case is a warning rather than a note."""
    device = str(resolve_device(None))
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 1
    if gpus > 1:
        logger.warning("%s: device_map='auto' runs the whole model on %s (a blend needs the model on one device; "
                       "this machine has %d GPUs); pass device='cuda:N' to choose another", owner, device, gpus)
    else:
        logger.info("%s: device_map='auto' maps to device=%r, the one device here", owner, device)
    return device


__all__ = ["BLEND_FIELDS", "SAMPLING_FIELDS", "checked_as_given", "hugging_face_spellings", "unknown_names_error"]
