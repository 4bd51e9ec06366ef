"""A stable identity for a loaded model: architecture, config, tokenizer and weights.

Chunk KV is only valid for the exact model that produced it, so every store key
and every ChunkKV carries this fingerprint. It is built from content (never
Python's ``hash()``), so it is the same across processes and machines.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

_DIGEST_ATTR = "_cacheblend_weights_digest"
# Config keys that describe where or how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation",
                         "_commit_hash", "quantization_config", "architectures"}


def set_weights_digest(model: nn.Module, digest: str) -> None:
    """Record a digest computed from the weight files, so it need not be recomputed from tensors."""
    setattr(model, _DIGEST_ATTR, digest)


def weights_digest(model: nn.Module) -> str:
    """Digest of every parameter and buffer (cached on the model object)."""
    cached = getattr(model, _DIGEST_ATTR, None)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = tensor.detach().to("cpu").contiguous()
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    digest = h.hexdigest()
    set_weights_digest(model, digest)
    return digest


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
