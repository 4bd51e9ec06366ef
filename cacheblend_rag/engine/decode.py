"""Decoding, one token per request per step, for one request or many at once.

A request's :class:`DecodingKV` holds each layer's rotated keys and values from the blend in a
buffer with room for every token still to come, so a step writes one position in place
(transformers' ``DynamicCache`` concatenates, copying the whole cache every step).

:func:`decode_logits` runs one step for a batch of requests: embeddings, norms, projections and
MLPs as one matrix product over the batch (the weights are read once for all of them, which is
what makes batched decoding cheaper per token), and each request's attention over its own keys,
so requests of different lengths need neither padding nor masks. A request alone takes the same
path, so the engine's own ``generate`` and a server's batch of one compute the same numbers.

:class:`Decoding` is one request's side of it: its sampler, stop strings, text so far and finish
reason. It holds no thread and no lock; :mod:`cacheblend_rag.serving.scheduler` drives many.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.engine.results import BlendResult, GenerationResult
from cacheblend_rag.models.adapters import DecoderAdapter


class DecodingModel(Protocol):
    """What decoding reads of an engine: the model and its adapter (``None``: the model's own
    forward decodes), the tokenizer that turns tokens into text, and the context window. The
    engine and a server's scheduler both drive decoding, so it names these instead of importing
    the engine, which imports it."""

    model: torch.nn.Module
    tokenizer: Any
    adapter: DecoderAdapter | None
    device: torch.device

    @property
    def context_window(self) -> int: ...


class Sampler(Protocol):
    """Picks a request's next token from its logits and the answer so far
    (:class:`~cacheblend_rag.engine.generate.TokenSampler` is the one the engine uses)."""

    def __call__(self, logits: torch.Tensor, generated: Sequence[int] = ()) -> int: ...


class DecodingKV:
    """One request's keys (rotated) and values for decoding, layer by layer, with room to grow.

    A sliding-window layer of the blend's cache holds only its last tokens; attention then reads
    the last ``window`` entries, which are the positions such a layer sees."""

    def __init__(self, cache: Any, room: int) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        for layer in cache.layers:
            k, v = layer.keys, layer.values  # [1, kv_heads, n, head_dim]
            n = k.shape[2]
            keys = k.new_empty((1, k.shape[1], n + room, k.shape[3]))
            values = v.new_empty((1, v.shape[1], n + room, v.shape[3]))
            keys[:, :, :n], values[:, :, :n] = k, v
            self.keys.append(keys)
            self.values.append(values)
            self.lengths.append(n)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's ``k``/``v`` (``[1, kv_heads, 1, head_dim]``) after the layer's last;
        returns the layer's keys and values up to it (views, no copy)."""
        n = self.lengths[layer]
        if n == self.keys[layer].shape[2]:  # more steps than planned for (a caller's choice): double
            self.keys[layer] = torch.cat([self.keys[layer], torch.empty_like(self.keys[layer])], dim=2)
            self.values[layer] = torch.cat([self.values[layer], torch.empty_like(self.values[layer])], dim=2)
        self.keys[layer][:, :, n] = k[:, :, 0]
        self.values[layer][:, :, n] = v[:, :, 0]
        self.lengths[layer] = n + 1
        return self.keys[layer][:, :, : n + 1], self.values[layer][:, :, : n + 1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@torch.inference_mode()
def decode_logits(engine: DecodingModel, batch: Sequence["Decoding"]) -> torch.Tensor:
    """One decoding step for every request of ``batch`` (none finished): feeds each its pending
    token at its position and returns the next-token logits, ``[len(batch), vocab]``."""
    a = engine.adapter
    device = engine.device
    if a is None:  # an architecture served by full prefill only: the model's own forward, one by one
        return torch.stack([_model_forward(engine, d) for d in batch])
    ids = torch.tensor([[d.token] for d in batch], dtype=torch.long, device=device)
    positions = torch.tensor([[d.position] for d in batch], dtype=torch.long, device=device)
    hidden = a.embed(ids)
    cos, sin = a.rope_cos_sin(hidden, positions)
    gqa = a.num_heads != a.num_kv_heads
    for layer in range(a.num_layers):
        q, k, v = a.qkv(layer, a.input_norm(layer, hidden))
        q, k = a.apply_rope(q, cos, sin), a.apply_rope(k, cos, sin)
        window, scale = a.sliding_window(layer), a.attention_scale(layer)
        out = torch.empty_like(q)
        for row, d in enumerate(batch):
            keys, values = d.kv.append(layer, k[row : row + 1], v[row : row + 1])  # type: ignore[union-attr]
            if window is not None and keys.shape[2] > window:
                keys, values = keys[:, :, -window:], values[:, :, -window:]
            out[row : row + 1] = F.scaled_dot_product_attention(q[row : row + 1], keys, values, scale=scale,
                                                                enable_gqa=gqa)
        hidden = a.mlp_block(layer, hidden + a.attention_output(layer, out))
    return a.final_logits(hidden)[:, -1]


def _model_forward(engine: DecodingModel, d: "Decoding") -> torch.Tensor:
    ids = torch.tensor([[d.token]], dtype=torch.long, device=engine.device)
    pos = torch.tensor([[d.position]], dtype=torch.long, device=engine.device)
    return engine.model(input_ids=ids, cache=d.cache, position_ids=pos, use_cache=True).logits[0, -1]


def complete_text(text: str) -> str:
    """``text`` without the replacement characters a decode leaves for a character whose bytes are
    cut off at its end (an answer cut by ``max_new_tokens``, or a token that splits a character)."""
    return text.rstrip("\ufffd")


class Decoding:
    """One request being decoded: the blend's output, the sampler, the tokens and text so far.

    Call :meth:`accept` for the pending token (it returns the text it adds, if any, and may
    finish the request), then, unless :attr:`done`, run a step (:func:`decode_logits`) and hand
    this request its logits through :meth:`advance`."""

    def __init__(self, engine: DecodingModel, gen: GenerationConfig, blended: BlendResult,
                 sampler: Sampler, eos: set[int], started: float) -> None:
        self.engine = engine
        self.gen = gen
        self.sampler = sampler
        self.eos = eos
        self.started = started
        self.stats = blended.stats
        self.prompt_ids = blended.input_ids
        self.prompt_tokens = len(blended.input_ids)
        self.window = engine.context_window
        self.token = sampler(blended.logits)  # the pending token: sampled, not yet accepted
        self.ttft = time.perf_counter() - started
        self.position = self.prompt_tokens  # where the pending token goes, once accepted and fed
        self.tokens: list[int] = []
        self.emitted = ""
        self.finish: str | None = None
        # Characters that could start a stop string are held back until they cannot.
        self.hold = max((len(s) for s in gen.stop), default=1) - 1
        self.room = max(1, min(gen.max_new_tokens - 1, self.window - self.prompt_tokens))
        self.cache: Any = blended.cache  # the blend's; the model's own forward decodes it without an adapter
        self._kv: DecodingKV | None = None
        # Called once the request finishes, while its KV is still held (a server keeps the prefix).
        self.on_finish: Callable[["Decoding"], None] | None = None

    @property
    def kv(self) -> DecodingKV | None:
        """The request's decoding KV, copied from the blend's cache at its first step (not before, so
        the first token reaches the caller without waiting for the copy)."""
        if self._kv is None and self.cache is not None and self.engine.adapter is not None:
            self._kv, self.cache = DecodingKV(self.cache, self.room), None
        return self._kv

    @property
    def done(self) -> bool:
        return self.finish is not None

    def accept(self) -> str:
        """Take the pending token: the text it adds (``""`` when none is safe to show yet)."""
        token = self.token
        if token in self.eos:
            return self._finish("eos")
        self.tokens.append(token)
        text = self.engine.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hit = min((i for i in (text.find(s) for s in self.gen.stop) if i >= 0), default=-1)
        if hit >= 0:
            return self._finish("stop", text[:hit])
        if len(self.tokens) >= self.gen.max_new_tokens or self.position >= self.window:
            # The window is full: the model has no position left for the next token.
            return self._finish("length", complete_text(text))
        safe = text[: len(text) - self.hold] if self.hold else text
        if safe.endswith("\ufffd") or len(safe) <= len(self.emitted):  # an incomplete character, or nothing new
            return ""
        delta, self.emitted = safe[len(self.emitted):], safe
        return delta

    def advance(self, logits: torch.Tensor) -> None:
        """Sample the next pending token from this request's logits of the step that fed the last one."""
        self.token = self.sampler(logits, self.tokens)
        self.position += 1

    def _finish(self, reason: str, text: str | None = None) -> str:
        self.finish = reason
        if text is None:
            text = complete_text(self.engine.tokenizer.decode(self.tokens, skip_special_tokens=True))
        delta = text[len(self.emitted):] if len(text) > len(self.emitted) else ""
        self.emitted = text
        if self.on_finish is not None:
            self.on_finish(self)
        self.release()
        return delta

    def held_kv(self) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """The token ids whose K/V this request holds (the prompt, then the answer tokens already fed)
        and each layer's keys (rotated) and values, ``[1, kv_heads, >= len(ids), head_dim]``. Nothing
        where a sliding window has dropped the opening tokens from a layer."""
        if self._kv is not None:
            keys, values, lengths = self._kv.keys, self._kv.values, self._kv.lengths
        elif self.cache is not None:
            keys, values = [l.keys for l in self.cache.layers], [l.values for l in self.cache.layers]
            lengths = [k.shape[2] for k in keys]
        else:
            return [], [], []
        length = min(lengths)
        a = self.engine.adapter
        windows = [a.sliding_window(layer) for layer in range(a.num_layers)] if a is not None else [0]
        if len(set(lengths)) != 1 or any(w is not None and w < length for w in windows):
            return [], [], []
        ids = [*self.prompt_ids, *self.tokens]
        return ids[:length], keys, values

    def release(self) -> None:
        """Drop the request's KV (it is finished, cancelled or failed)."""
        self._kv = None
        self.cache = None

    def result(self) -> GenerationResult:
        return GenerationResult(
            text=self.emitted, token_ids=list(self.tokens), finish_reason=self.finish or "length",
            prompt_tokens=self.prompt_tokens, ttft_s=self.ttft, total_s=time.perf_counter() - self.started,
            stats=self.stats, timings={"blend_s": self.stats.timings.get("total", 0.0)},
        )
