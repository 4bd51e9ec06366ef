"""What the arguments that choose a model resolve to, so that one model loads once per process.

``ChatCacheBlend()``, ``ChatCacheBlend(device="cpu")`` and
``ChatCacheBlend(model="SmolLM2-135M-Instruct", dtype="float32")`` name the same weights on the same
device in the same dtype; keyed as written they would load three copies (on a GPU with a 7B model, an
out-of-memory error). :func:`engine_key` turns the arguments into what they mean before the registry
keys on them: the model's source (the GGUF file a name or catalog entry stands for, a folder's
absolute path, a hub id), the device the loader would use and the dtype it would pick
(:mod:`~cacheblend_rag.models.dtype_choice`, ``$CACHEBLEND_DTYPE`` included). Settings that leave the
weights alone (blend settings, sampling) are not part of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cacheblend_rag.models import catalog, loader
from cacheblend_rag.models.dtype_choice import PROBE_FILE, choose_dtype, dtype_name
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME, cache_root, default_gguf_path, resolve_device

# Tiny random models (cacheblend_rag.models.tiny): a full pipeline in milliseconds, for tests.
TINY_MODEL_PREFIX = "tiny-"
TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# What cacheblend_rag.engine.tiny.tiny_engine builds when no device or dtype is asked for (the registry asks
# for none: a tiny model's dtype is always its own).
_TINY_DEVICE, _TINY_DTYPE = "cpu", "float32"
# Model widths read for the CPU's auto dtype, per source and options: reading one verifies a GGUF's converted
# copy (hashing it), which a process does once per model, not once per object made.
_widths: dict[tuple[str, str], int | None] = {}


@dataclass(frozen=True)
class EngineKey:
    """One engine's identity: its weights' ``source`` (``gguf:<file>``, ``folder:<path>``, ``hub:<id>``,
    ``tiny:<arch>``), the ``device`` and ``dtype`` they are loaded on and in, the tokenizer they are read
    with (``None``: the model's own) and the ``from_pretrained`` options, written out."""

    source: str
    device: str
    dtype: str
    tokenizer: str | None
    options: str


def is_tiny_model_name(model: str) -> bool:
    return model.startswith(TINY_MODEL_PREFIX) and not os.path.exists(model)


def loader_model_argument(model: str) -> str | None:
    """What the loader takes for ``model``: ``None`` for the embedded model's name, else ``model``."""
    return None if model == DEFAULT_MODEL_NAME else model


def loader_device_argument(device: str | None) -> str | None:
    """What the loader takes for ``device``: ``None`` (the best device here) for ``None`` and ``"auto"``."""
    return None if device is None or str(device).strip().lower() == "auto" else device


def model_source(model: str) -> str:
    """The weights ``model`` names, spelt one way: the embedded model's name and a catalog name are the
    GGUF files they stand for (a catalog model need not be fetched yet: its load says how), a path is
    absolute, anything else is a hub id."""
    if is_tiny_model_name(model):
        return f"tiny:{model[len(TINY_MODEL_PREFIX):]}"
    if model == DEFAULT_MODEL_NAME:
        return f"gguf:{default_gguf_path().resolve()}"
    known = catalog.lookup(model)
    if known is not None:
        return f"gguf:{catalog.fetched_path(known, cache_root()).resolve()}"
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return f"gguf:{path.resolve()}"
    if path.is_dir():
        return f"folder:{path.resolve()}"
    return f"hub:{model}"


def resolved_device(device: str | None) -> str:
    """The device a load with ``device`` runs on, with its index (``"cuda"`` is the current CUDA device)."""
    resolved = resolve_device(loader_device_argument(device))
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return str(resolved)


def model_width(model: str, model_kwargs: dict[str, Any]) -> int | None:
    """The hidden width of the model a load of ``model`` reads, from its config alone, as the loader reads it
    for the CPU's auto dtype (its own helpers: the same folder, hub options and config)."""
    folder, _, _, _ = loader._locate(loader_model_argument(model))
    target = str(folder) if folder is not None else model
    hub_options = {} if folder is not None else loader._hub_options(model)
    return loader._hidden_width(target, hub_options, dict(model_kwargs))


def engine_key(model: str, device: str | None, dtype: str | None, tokenizer: str | None,
               model_kwargs: dict[str, Any]) -> EngineKey:
    """The identity of the engine these arguments load (what the registry keys on). The dtype is the one
    the loader would choose; on a CPU whose auto choice must measure bfloat16, the model's width is read
    from its config (a GGUF is converted first, once, as its load would)."""
    options = repr(sorted(model_kwargs.items()))
    tokenizer_source = None
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        tokenizer_source = str(path.resolve()) if path.exists() else str(tokenizer)
    if is_tiny_model_name(model):
        where = _TINY_DEVICE if loader_device_argument(device) is None else resolved_device(device)
        return EngineKey(model_source(model), where, _TINY_DTYPE, tokenizer_source, options)
    source, where = model_source(model), resolved_device(device)

    def width() -> int | None:
        if (source, options) not in _widths:
            _widths[source, options] = model_width(model, model_kwargs)
        return _widths[source, options]

    choice = choose_dtype(dtype, torch.device(where), width, cache_root() / PROBE_FILE)
    return EngineKey(source, where, dtype_name(choice.dtype), tokenizer_source, options)


__all__ = ["EngineKey", "TINY_ARCHITECTURES", "TINY_MODEL_PREFIX", "engine_key", "is_tiny_model_name", "model_source",
           "resolved_device"]
