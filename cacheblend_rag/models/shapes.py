"""A decoder's shapes, read from its transformers config: what the work bound (``calibration.bound``) and the
scheduler's KV budget (``serving.admission``) both count with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerShapes:
    """What the bound needs of a decoder: its depth and the weights one token passes through per layer."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @classmethod
    def of(cls, config: Any) -> "LayerShapes":
        """The shapes of a transformers config (a multimodal one's text config)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate_size=int(config.intermediate_size),
        )

    def weights(self) -> dict[str, int]:
        """Weights per token per layer: the Q/K/V/O projections and a gated MLP (biases and norms left out)."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = self.hidden_size * self.num_kv_heads * self.head_dim
        return {"q": q, "k": kv, "v": kv, "o": q, "mlp": 3 * self.hidden_size * self.intermediate_size}

    @property
    def qkv_share(self) -> float:
        w = self.weights()
        return (w["q"] + w["k"] + w["v"]) / sum(w.values())

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K/V one token takes at ``itemsize`` bytes a value: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize
