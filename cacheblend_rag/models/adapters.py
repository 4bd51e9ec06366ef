"""Layer-wise access to Hugging Face decoder models, without copying weights.

The blending engine needs to run one decoder layer at a time on an arbitrary
subset of tokens, and to see K before RoPE. An adapter exposes exactly those
pieces of a loaded ``*ForCausalLM`` by pointing at its own modules, so the
numbers it produces are the model's numbers: same norms, same projections, the
model's own rotary embedding (so llama3, linear or dynamic rope scaling is
honoured), same MLP.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from cacheblend_rag.errors import UnsupportedArchitectureError


class DecoderAdapter:
    """Llama-family decoder: Llama, Mistral and Qwen2 share this layout.

    Shapes: hidden states are ``[batch, tokens, hidden]``; queries are
    ``[batch, heads, tokens, head_dim]``; keys and values are
    ``[batch, kv_heads, tokens, head_dim]`` (GQA when ``kv_heads < heads``).
    """

    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.decoder = model.model
        self.config = model.config.get_text_config(decoder=True)
        self.layers = self.decoder.layers
        self.num_layers: int = len(self.layers)
        self.num_heads: int = self.config.num_attention_heads
        self.num_kv_heads: int = self.config.num_key_value_heads
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.hidden_size: int = self.config.hidden_size
        self.max_positions: int = getattr(self.config, "max_position_embeddings", 1 << 30)

    # -- embeddings and head --------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.decoder.norm(hidden))

    # -- rotary embedding -----------------------------------------------------
    def rope_cos_sin(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` (``[batch, tokens]``), each ``[batch, tokens, head_dim]``."""
        return self.decoder.rotary_emb(like, positions)

    @staticmethod
    def rope_halves(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of ``[batch, tokens, head_dim]`` as :meth:`apply_rope` uses them, ``[batch, 1, tokens,
        head_dim / 2]``: a blend rotates at the same positions several times a layer, and on a GPU each
        slicing is a launch of its own."""
        half = cos.shape[-1] // 2
        return cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)

    @staticmethod
    def apply_rope(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate ``x`` (``[batch, heads, tokens, head_dim]``) with cos/sin of ``[batch, tokens, head_dim]``,
        or with their :meth:`rope_halves` (prepared once for many rotations at the same positions).

        Same arithmetic as ``x * cos + rotate_half(x) * sin`` (transformers builds cos/sin as two
        equal halves for every rope type), but without materialising ``rotate_half``'s
        concatenation: on a CPU the copies cost as much as the multiplications.
        """
        half = x.shape[-1] // 2
        c, s = DecoderAdapter.rope_halves(cos, sin) if cos.dim() == 3 else (cos, sin)
        x1, x2 = x[..., :half], x[..., half:]
        if out is None:
            out = torch.empty_like(x)
        torch.sub(x1 * c, x2 * s, out=out[..., :half])
        torch.add(x2 * c, x1 * s, out=out[..., half:])
        return out

    # -- one layer, piece by piece --------------------------------------------
    def input_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].input_layernorm(hidden)

    def qkv(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (before RoPE) and V for ``normed`` hidden states."""
        attn = self.layers[layer].self_attn
        b, t, _ = normed.shape
        q = attn.q_proj(normed).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = attn.k_proj(normed).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = attn.v_proj(normed).view(b, t, -1, self.head_dim).transpose(1, 2)
        return q, k, v

    def attention_scale(self, layer: int) -> float:
        return float(self.layers[layer].self_attn.scaling)

    def sliding_window(self, layer: int) -> int | None:
        attn = self.layers[layer].self_attn
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window
        return getattr(self.config, "sliding_window", None)

    def attention_output(self, layer: int, attn_out: torch.Tensor) -> torch.Tensor:
        """``attn_out`` is ``[batch, heads, tokens, head_dim]``; returns ``[batch, tokens, hidden]``."""
        b, _, t, _ = attn_out.shape
        merged = attn_out.transpose(1, 2).reshape(b, t, -1)
        return self.layers[layer].self_attn.o_proj(merged)

    def mlp_block(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Residual MLP half of the layer: ``hidden + mlp(post_norm(hidden))``."""
        block = self.layers[layer]
        return hidden + block.mlp(block.post_attention_layernorm(hidden))


class Qwen3Adapter(DecoderAdapter):
    """Qwen3 normalises each head's q and k (q_norm/k_norm) before RoPE."""

    model_types: ClassVar[tuple[str, ...]] = ("qwen3",)

    def qkv(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self.layers[layer].self_attn
        b, t, _ = normed.shape
        q = attn.q_norm(attn.q_proj(normed).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(normed).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = attn.v_proj(normed).view(b, t, -1, self.head_dim).transpose(1, 2)
        return q, k, v


ADAPTERS: dict[str, type[DecoderAdapter]] = {
    model_type: cls for cls in (DecoderAdapter, Qwen3Adapter) for model_type in cls.model_types
}


def supported_architectures() -> list[str]:
    return sorted(ADAPTERS)


def get_adapter(model: nn.Module) -> DecoderAdapter:
    """The adapter for ``model``, or :class:`UnsupportedArchitectureError` listing what is supported."""
    model_type = getattr(model.config, "model_type", None)
    cls = ADAPTERS.get(model_type)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported for blending; supported: "
            f"{', '.join(supported_architectures())}. Pass BlendConfig(fallback_to_full_prefill=True) "
            "to serve it with full prefill instead."
        )
    return cls(model)
