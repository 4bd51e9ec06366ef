"""A stable identity for a loaded model: architecture, config, tokenizer and weights.

Chunk KV is only valid for the exact model that produced it, so every store key
and every ChunkKV carries this fingerprint. It is built from content (never
Python's ``hash()``), so it is the same across processes and machines.

The weights' digest is remembered per model object together with a *stamp*: each tensor's
storage address, version counter (which torch advances on every in-place change), shape and
dtype. Taking the stamp costs well under a millisecond; when it differs (weights changed in
place, replaced, or a copy of the model), the digest is computed again from the tensors. A
model whose weights are inference tensors has no version counters: then in-place changes
cannot be seen, and :func:`weights_stamp` says so (``tracks_changes``).

The fingerprint holds the compute dtype, as chunk KV must. What the weights *are*, whatever dtype
they were loaded in, is :func:`weights_identities`: the GGUF file they came from, when the loader
knows it, and their content rounded to bfloat16 (float32 and bfloat16 loads of the same checkpoint
round to the same bytes). Calibrations are found by these across dtypes (``engine.calibrated``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import weakref
from typing import Any, NamedTuple

import torch
import xxhash
from torch import nn

# model -> (stamp, digest): weak, so a model's entry goes with it; a copy of a model is another key.
_DIGESTS: "weakref.WeakKeyDictionary[nn.Module, tuple[WeightsStamp, str]]" = weakref.WeakKeyDictionary()
_CANONICAL: "weakref.WeakKeyDictionary[nn.Module, tuple[WeightsStamp, str]]" = weakref.WeakKeyDictionary()
# model -> (stamp when loaded, source identity): the file the loader read the weights from, while they are unchanged
_SOURCES: "weakref.WeakKeyDictionary[nn.Module, tuple[WeightsStamp, str]]" = weakref.WeakKeyDictionary()


class WeightsStamp(NamedTuple):
    tensors: tuple[tuple[str, int, int | None, tuple[int, ...], str], ...]

    @property
    def tracks_changes(self) -> bool:
        """Whether in-place changes show in the stamp (inference tensors keep no version counter)."""
        return all(version is not None for _, _, version, _, _ in self.tensors)


def weights_stamp(model: nn.Module) -> WeightsStamp:
    """What changes when a weight changes: every parameter's and buffer's storage, version, shape, dtype."""
    parts = []
    seen: set[int] = set()  # a tied weight once, as named_parameters() gives it
    # One walk of the modules for parameters and buffers alike: blends read the stamp twice each, and
    # named_parameters() and named_buffers() walked the model once apiece (0.4 ms more a call on a 1.5B shape).
    for prefix, module in model.named_modules():
        for name, tensor in itertools.chain(module._parameters.items(), module._buffers.items()):
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            try:
                version: int | None = tensor._version
            except RuntimeError:  # an inference tensor
                version = None
            parts.append((f"{prefix}.{name}" if prefix else name, tensor.data_ptr(), version, tuple(tensor.shape),
                          str(tensor.dtype)))
    return WeightsStamp(tuple(parts))
# Config keys that describe where or how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation",
                         "_commit_hash", "quantization_config", "architectures"}


def weights_digest(model: nn.Module) -> str:
    """Digest of every parameter and buffer, computed again whenever :func:`weights_stamp` changes."""
    return _cached_digest(model, _DIGESTS, None)


def canonical_weights_digest(model: nn.Module) -> str:
    """:func:`weights_digest` of the model with every floating tensor rounded to bfloat16: the same for a
    float32 and a bfloat16 load of one checkpoint (torch rounds both ways to nearest even). A float16 load
    rounds twice and differs. For a model already in bfloat16 it is :func:`weights_digest`, at no cost."""
    floats = [t.dtype for t in model.state_dict().values() if t.is_floating_point()]
    if floats and all(dtype == torch.bfloat16 for dtype in floats):
        return weights_digest(model)
    return _cached_digest(model, _CANONICAL, torch.bfloat16)


def _cached_digest(model: nn.Module, cache: "weakref.WeakKeyDictionary[nn.Module, tuple[WeightsStamp, str]]",
                   floats_as: torch.dtype | None) -> str:
    stamp = weights_stamp(model)
    known = cache.get(model)
    if known is not None and known[0] == stamp:
        return known[1]
    # XXH3: a content identity, not a defence against crafted weights; about 10x faster than SHA-256.
    h = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = tensor.detach().to("cpu")
        if floats_as is not None and t.is_floating_point():
            t = t.to(floats_as)
        t = t.contiguous()
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    digest = h.hexdigest()
    cache[model] = (stamp, digest)
    return digest


def record_weights_source(model: nn.Module, identity: str) -> None:
    """Say where ``model``'s weights were read from (``"gguf-sha256:<digest>"``): one of its
    :func:`weights_identities` until its weights change."""
    _SOURCES[model] = (weights_stamp(model), identity)


def source_identity(model: nn.Module, stamp: WeightsStamp | None = None) -> str | None:
    """The identity :func:`record_weights_source` gave, if the weights are still as they were loaded."""
    known = _SOURCES.get(model)
    if known is None:
        return None
    return known[1] if known[0] == (stamp if stamp is not None else weights_stamp(model)) else None


def weights_shape(model: nn.Module) -> dict[str, Any]:
    """The architecture, width and depth: a cheap first filter before any weights are hashed."""
    text = model.config.get_text_config(decoder=True)
    return {"architecture": getattr(model.config, "model_type", type(model).__name__),
            "hidden_size": getattr(text, "hidden_size", None), "num_hidden_layers": getattr(text, "num_hidden_layers", None)}


# model -> (stamp, id of the tokenizer, identity): the tokenizer's digest alone takes tens of milliseconds
_CONTENT: "weakref.WeakKeyDictionary[nn.Module, tuple[WeightsStamp, int, str]]" = weakref.WeakKeyDictionary()


def content_identity(model: nn.Module, tokenizer: Any = None) -> str:
    """``"content:<sha256>"`` of the architecture, config, tokenizer and :func:`canonical_weights_digest`:
    what the model computes, up to the dtype it computes in."""
    stamp = weights_stamp(model)
    known = _CONTENT.get(model)
    if known is not None and known[:2] == (stamp, id(tokenizer)):
        return known[2]
    payload = {
        "architecture": getattr(model.config, "model_type", type(model).__name__),
        "config": _config_dict(model),
        "tokenizer": tokenizer_digest(tokenizer),
        "weights_bfloat16": canonical_weights_digest(model),
    }
    identity = "content:" + hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
    _CONTENT[model] = (stamp, id(tokenizer), identity)
    return identity


def weights_identities(model: nn.Module, tokenizer: Any = None) -> list[str]:
    """Every identity of the model's weights that holds across dtypes: the file they were loaded from
    (while unchanged), then :func:`content_identity` (which hashes the weights once per change)."""
    source = source_identity(model)
    return ([source] if source else []) + [content_identity(model, tokenizer)]


def _config_dict(model: nn.Module) -> dict[str, Any]:
    cfg = model.config.to_dict()
    return {k: v for k, v in sorted(cfg.items()) if k not in _VOLATILE_CONFIG_KEYS}


def tokenizer_digest(tokenizer: Any) -> str:
    if tokenizer is None:
        return "no-tokenizer"
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode())
    return h.hexdigest()


def model_fingerprint(model: nn.Module, tokenizer: Any = None, compute_dtype: torch.dtype | None = None) -> str:
    """Hex digest identifying what the model computes, independent of where it was loaded from.

    ``compute_dtype`` is part of it, because KV computed in bf16 differs from fp32.
    """
    payload = {
        "architecture": getattr(model.config, "model_type", type(model).__name__),
        "config": _config_dict(model),
        "tokenizer": tokenizer_digest(tokenizer),
        "weights": weights_digest(model),
        "compute_dtype": str(compute_dtype or next(model.parameters()).dtype),
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
