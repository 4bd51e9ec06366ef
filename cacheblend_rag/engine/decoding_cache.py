"""The decoding cache: a blend's merged K (rotated) and V per layer as a transformers cache, which the model's own
forward (and so decoding) reads. Kept beside the blend that fills it rather than in ``generate.py``, so a blend
reads one way: ``blend.py`` -> ``blend_run.py`` -> here."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def decoding_cache(model_config: Any, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A transformers cache holding each layer's merged K (rotated) and V, for the model's own forward."""
    cache = DynamicCache(config=model_config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        slot = cache.layers[layer] if layer < len(getattr(cache, "layers", ())) else None
        if type(slot) is DynamicLayer and not slot.is_initialized:
            # A plain layer's first update concatenates onto an empty tensor, which copies the
            # whole merged layer (docs/design.md, "Blend", step 5, has its cost), and even an empty
            # update makes two tensors and two copies a layer. The merged tensors are ours to hand
            # over: the layer is left as its first update would leave it (a test holds the two equal).
            slot.device, slot.keys, slot.values, slot.is_initialized = k.device, k, v, True
        else:  # sliding-window and other layer kinds keep their own bookkeeping
            cache.update(k, v, layer)
    return cache


__all__ = ["decoding_cache"]
