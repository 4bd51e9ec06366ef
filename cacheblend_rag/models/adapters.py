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
import torch.nn.functional as F
from torch import nn

from cacheblend_rag.errors import UnsupportedArchitectureError

# transformers' RMSNorm of these families: ``weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(dtype)``.
_PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


class FusedProjections:
    """Each layer's Q, K and V projections as one matrix multiplication (as vLLM's QKVParallelLinear):
    the three weights (and biases) side by side in one tensor, built the first time a layer is used.

    The model's own weights are left as they are, so the fused copy costs their memory again (Q, K and V
    are 6-12% of a Llama-family model's weights). It is rebuilt when one of them is replaced or changed in
    place (their version counters), and never built for projections that are not plain ``nn.Linear``
    (quantized layers): those run one by one, their outputs concatenated."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self._fused: dict[int, tuple[tuple, torch.Tensor, torch.Tensor | None] | None] = {}

    @staticmethod
    def _modules(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
        attn = layer.self_attn
        return attn.q_proj, attn.k_proj, attn.v_proj

    @staticmethod
    def _stamp(modules: tuple[nn.Module, ...]) -> tuple | None:
        """What identifies the weights' current values; ``None`` where the projections cannot be fused or
        their changes cannot be seen (inference tensors keep no version counter)."""
        if any(type(m) is not nn.Linear for m in modules):
            return None
        try:
            return tuple((t.data_ptr(), t._version) for m in modules for t in (m.weight, m.bias) if t is not None)
        except RuntimeError:
            return None

    def project(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """``normed`` through the layer's Q, K and V projections: ``[batch, tokens, (heads + 2 * kv_heads) *
        head_dim]``."""
        modules = self._modules(self.layers[layer])
        stamp = self._stamp(modules)
        if stamp is None:
            return torch.cat([m(normed) for m in modules], dim=-1)
        fused = self._fused.get(layer)
        if fused is None or fused[0] != stamp:
            weight = torch.cat([m.weight for m in modules]).detach()
            biases = [m.bias for m in modules]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([b if b is not None else m.weight.new_zeros(m.out_features)
                                  for m, b in zip(modules, biases)]).detach()
            fused = self._fused[layer] = (stamp, weight, bias)
        return F.linear(normed, fused[1], fused[2])


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
        self.qk_heads: int = self.num_heads + self.num_kv_heads  # the heads one rotation turns
        self._qkv_weights = FusedProjections(self.layers)

    # -- embeddings and head --------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._rms_norm(self.decoder.norm, hidden))

    # -- rotary embedding -----------------------------------------------------
    def rope_cos_sin(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` (``[batch, tokens]``), each ``[batch, tokens, head_dim]``."""
        return self.decoder.rotary_emb(like, positions)

    @staticmethod
    def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of ``[batch, tokens, head_dim]`` as :meth:`apply_rope` uses them, ``[batch, 1, tokens,
        head_dim]``: cos as is, and sin with its first half negated, so a rotation is ``x * cos + roll(x) *
        sin`` (``rotate_half``'s negation and concatenation folded into the table). A blend
        rotates at the same positions several times a layer: it prepares these once."""
        half = cos.shape[-1] // 2
        signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos.unsqueeze(1), signed.unsqueeze(1)

    @staticmethod
    def apply_rope(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate ``x`` (``[batch, heads, tokens, head_dim]``) with cos/sin of ``[batch, tokens, head_dim]``
        (a negated ``sin`` rotates back), or with their :meth:`rope_tables` (prepared once for many
        rotations at the same positions).

        Same arithmetic as transformers' ``x * cos + rotate_half(x) * sin`` (which builds cos/sin as two
        equal halves for every rope type): ``rotate_half(x)`` is ``roll(x)`` with its first half negated,
        and the negation sits in the prepared sin. Four operations instead of about ten, which is what a
        blend pays for on a GPU (a launch each) and on a CPU (a dispatch and a pass over memory each).
        """
        c, s = DecoderAdapter.rope_tables(cos, sin) if cos.dim() == 3 else (cos, sin)
        # Each product rounded before the sum, as transformers rounds them: in half precision a fused
        # multiply-add (``addcmul``) would differ from the model's own prefill by as much as half precision
        # itself does, and ratio 1.0 would no longer equal full prefill.
        rolled = torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(s)
        if out is None:
            return rolled.add_(x * c)
        return torch.mul(x, c, out=out).add_(rolled)

    # -- one layer, piece by piece --------------------------------------------
    def input_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(self.layers[layer].input_layernorm, hidden)

    @staticmethod
    def _rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm (``weight * (x / rms(x))``, computed in float32 as transformers does) as one
        fused ``rms_norm`` instead of the module's eight operations. Norms of another form (no
        ``variance_epsilon``) run as the model's module."""
        eps = getattr(norm, "variance_epsilon", None)
        if eps is None or type(norm).__name__ not in _PLAIN_RMS_NORMS:
            return norm(hidden)
        if hidden.dtype == torch.float32:
            return norm.weight * F.rms_norm(hidden, hidden.shape[-1:], eps=eps)
        return norm.weight * F.rms_norm(hidden.float(), hidden.shape[-1:], eps=eps).to(hidden.dtype)

    def qkv_heads(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """Q, K (before RoPE) and V of ``normed`` as one tensor of heads, ``[batch, heads + 2 * kv_heads,
        tokens, head_dim]`` (a view): one projection with the layer's three weights side by side
        (:class:`FusedProjections`), so one rotation can turn Q and K together."""
        b, t, _ = normed.shape
        return self._qkv_weights.project(layer, normed).view(b, t, -1, self.head_dim).transpose(1, 2)

    def qkv(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (before RoPE) and V for ``normed`` hidden states."""
        heads = self.qkv_heads(layer, normed)
        h, kv = self.num_heads, self.num_kv_heads
        return heads[:, :h], heads[:, h : h + kv], heads[:, h + kv :]

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
        return hidden + block.mlp(self._rms_norm(block.post_attention_layernorm, hidden))


class Qwen3Adapter(DecoderAdapter):
    """Qwen3 normalises each head's q and k (q_norm/k_norm) before RoPE."""

    model_types: ClassVar[tuple[str, ...]] = ("qwen3",)

    def qkv_heads(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        attn = self.layers[layer].self_attn
        b, t, _ = normed.shape
        heads = self._qkv_weights.project(layer, normed).view(b, t, -1, self.head_dim)
        h, qk = self.num_heads, self.qk_heads
        q, k = self._rms_norm(attn.q_norm, heads[:, :, :h]), self._rms_norm(attn.k_norm, heads[:, :, h:qk])
        return torch.cat([q, k, heads[:, :, qk:]], dim=2).transpose(1, 2)


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
