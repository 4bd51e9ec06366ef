"""An engine over a tiny random model (:mod:`cacheblend_rag.models.tiny`): what a ``tiny-*`` name loads."""

from __future__ import annotations

from typing import Any

import torch

from cacheblend_rag.models.tiny import tiny_model, tiny_tokenizer


def tiny_engine(
    arch: str = "llama", *, config: Any = None, seed: int = 0, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", **overrides: Any,
):
    """A :class:`~cacheblend_rag.engine.CacheBlendEngine` over a tiny model (in ``dtype``, on ``device``)
    with :func:`tiny_tokenizer`."""
    from cacheblend_rag.engine import CacheBlendEngine

    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, seed=seed, dtype=dtype, vocab_size=len(tokenizer), **overrides).to(device)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Test prompts are a few dozen tokens: they must blend, not fall back to full prefill.
    return CacheBlendEngine(model, tokenizer, config=config, model_name=f"tiny-{arch}", min_blend_tokens=0)


__all__ = ["tiny_engine"]
