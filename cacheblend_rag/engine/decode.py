"""Decoding, one token per request per step, for one request or many at once.

A request's :class:`DecodingKV` holds each layer's rotated keys and values from the blend in a
buffer with room for every token still to come, so a step writes one position in place
(transformers' ``DynamicCache`` concatenates, copying the whole cache every step).

:func:`decode_logits` runs one step for a batch of requests: embeddings, norms, projections and
MLPs as one matrix product over the batch (the weights are read once for all of them, which is
what makes batched decoding cheaper per token), and each request's attention over its own keys,
so requests of different lengths need neither padding nor masks. A request alone takes the same
path without the per-row slices and the concatenation, so the engine's own ``generate`` and a
server's batch of one compute the same numbers.

:class:`Decoding` is one request's side of it: its sampler, stop strings, text so far and finish
reason. It holds no thread and no lock; :mod:`cacheblend_rag.serving.scheduler` drives many. A
token costs one read back from the device (its id, which decides the end, the stop strings and the
text): the sampler works where the logits are, and the sampled tensor is the next step's input. The
text grows by decoding a few tokens (:class:`~cacheblend_rag.engine.detokenize.IncrementalText`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.engine.detokenize import IncrementalText
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
    (:class:`~cacheblend_rag.engine.sampling.TokenSampler` is the one the engine uses). A sampler may
    also offer ``sample(logits, generated)``, the id as a tensor on the logits' device: decoding then
    reads it back once and feeds the tensor itself to the next step."""

    def __call__(self, logits: torch.Tensor, generated: Sequence[int] = ()) -> int: ...


# Rotary types whose cos/sin at a position do not depend on the other positions asked for at the same time
# (dynamic NTK and longrope rescale by the longest position seen): their tables are built once per request.
_STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def _with_room(k: torch.Tensor, v: torch.Tensor, room: int) -> torch.Tensor | None:
    """The buffer ``k`` and ``v`` are the two halves of, ``[1, 2 * kv_heads, n + room, head_dim]`` with the keys
    first, as a blend's merged layers are made (``MergedLayers.read``); ``None`` if they are not. Read from
    their storage and strides: views made under ``torch.inference_mode`` keep no ``_base``."""
    heads, n, dim = k.shape[1], k.shape[2], k.shape[3]
    total = n + room
    stride = (2 * heads * total * dim, total * dim, dim, 1)
    if k.shape[0] != 1 or k.stride() != stride or v.stride() != stride or v.shape != k.shape or v.dtype != k.dtype:
        return None
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    if v.storage_offset() - k.storage_offset() != heads * total * dim:
        return None
    if (k.storage_offset() + stride[0]) * k.element_size() > k.untyped_storage().nbytes():
        return None
    return k.as_strided((1, 2 * heads, total, dim), stride, k.storage_offset())


class DecodingKV:
    """One request's keys (rotated) and values for decoding, layer by layer, with room to grow, and
    the rotary tables of the positions it will decode.

    A layer's keys and values share one buffer, ``[1, 2 * kv_heads, tokens, head_dim]`` (keys in the
    first heads): a step's rotated K and its V sit side by side in the fused projection's output, so
    one copy stores both. :attr:`keys` and :attr:`values` are views of the two halves.

    A sliding-window layer of the blend's cache holds only its last tokens; attention then reads
    the last ``window`` entries, which are the positions such a layer sees."""

    def __init__(self, cache: Any, room: int, adapter: DecoderAdapter | None = None, position: int = 0) -> None:
        self.buffers: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        for layer in cache.layers:
            k, v = layer.keys, layer.values  # [1, kv_heads, n, head_dim]
            n = k.shape[2]
            buffer = _with_room(k, v, room)
            if buffer is None:  # not the halves of a blend's buffer with room: copied into one
                buffer = k.new_empty((1, 2 * k.shape[1], n + room, k.shape[3]))
                buffer[:, : k.shape[1], :n], buffer[:, k.shape[1] :, :n] = k, v
            self._adopt(buffer)
            self.lengths.append(n)
        self.adapter = adapter
        self.start = position  # the position of the first token a step feeds
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        rope_type = getattr(getattr(getattr(adapter, "decoder", None), "rotary_emb", None), "rope_type", None)
        if adapter is not None and self.buffers and rope_type in _STATIC_ROPE:
            self._tables = self._rope_range(position, room)

    def _adopt(self, buffer: torch.Tensor, layer: int | None = None) -> None:
        heads = buffer.shape[1] // 2
        parts = (buffer, buffer[:, :heads], buffer[:, heads:])
        if layer is None:
            for store, part in zip((self.buffers, self.keys, self.values), parts):
                store.append(part)
        else:
            self.buffers[layer], self.keys[layer], self.values[layer] = parts

    def _rope_range(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.adapter
        assert a is not None
        like = self.buffers[0]
        positions = torch.arange(start, start + count, device=like.device).unsqueeze(0)
        return a.rope_tables(*a.rope_cos_sin(like, positions))  # [1, 1, count, head_dim] each

    def rope(self, position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`DecoderAdapter.rope_tables` at ``position``, ``[1, 1, 1, head_dim]`` each (views of tables
        built once); ``None`` for a rotary type that must be computed step by step."""
        if self._tables is None:
            return None
        index = position - self.start
        have = self._tables[0].shape[2]
        if index >= have:  # more steps than planned for (a caller's choice): double
            more = self._rope_range(self.start + have, max(have, index + 1 - have))
            self._tables = (torch.cat([self._tables[0], more[0]], dim=2), torch.cat([self._tables[1], more[1]], dim=2))
        return self._tables[0].narrow(2, index, 1), self._tables[1].narrow(2, index, 1)

    def append(self, layer: int, kv: torch.Tensor, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's rotated K and its V, ``[1, 2 * kv_heads, 1, head_dim]`` (keys first), after the
        layer's last; returns the layer's keys and values up to it, the last ``window`` only where one
        is given (views, no copy)."""
        n = self.lengths[layer]
        buffer = self.buffers[layer]
        if n == buffer.shape[2]:  # more steps than planned for (a caller's choice): double
            buffer = torch.cat([buffer, torch.empty_like(buffer)], dim=2)
            self._adopt(buffer, layer)
        buffer.narrow(2, n, 1).copy_(kv)
        self.lengths[layer] = n + 1
        start = n + 1 - window if window is not None and n + 1 > window else 0
        return self.keys[layer].narrow(2, start, n + 1 - start), self.values[layer].narrow(2, start, n + 1 - start)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers)


@torch.inference_mode()
def decode_logits(engine: DecodingModel, batch: Sequence["Decoding"]) -> torch.Tensor:
    """One decoding step for every request of ``batch`` (none finished): feeds each its pending
    token at its position and returns the next-token logits, ``[len(batch), vocab]``.

    A layer is about 30 operations for a request alone: the fused Q/K/V projection, one rotation
    of Q and K together written back into the projection's output (so the new K and its V lie side
    by side and one copy stores them), attention over views of the request's buffer, and the
    adapter's output projection and MLP. A batch adds, per request, the slices and the attention of
    its row, and one concatenation."""
    a = engine.adapter
    if a is None:  # an architecture served by full prefill only: the model's own forward, one by one
        return torch.stack([_model_forward(engine, d) for d in batch])
    kvs = [d.kv for d in batch]
    ids = batch[0].token_input() if len(batch) == 1 else torch.cat([d.token_input() for d in batch])
    hidden = a.embed(ids)
    rope = _rope_tables(a, batch, kvs, hidden)
    h, qk, gqa = a.num_heads, a.qk_heads, a.num_heads != a.num_kv_heads
    for layer in range(a.num_layers):
        qkv = a.qkv_heads(layer, a.input_norm(layer, hidden))  # [batch, heads + 2 * kv_heads, 1, head_dim]
        turned = qkv[:, :qk]
        a.apply_rope(turned, *rope, out=turned)  # in place: qkv then holds Q and K rotated, and V
        window, scale = a.sliding_window(layer), a.attention_scale(layer)
        if len(batch) == 1:
            keys, values = kvs[0].append(layer, qkv[:, h:], window)  # type: ignore[union-attr]
            out = F.scaled_dot_product_attention(qkv[:, :h], keys, values, scale=scale, enable_gqa=gqa)
        else:
            rows = []
            for row, kv in enumerate(kvs):
                keys, values = kv.append(layer, qkv[row : row + 1, h:], window)  # type: ignore[union-attr]
                rows.append(F.scaled_dot_product_attention(qkv[row : row + 1, :h], keys, values, scale=scale,
                                                           enable_gqa=gqa))
            out = torch.cat(rows)
        hidden = a.mlp_block(layer, hidden + a.attention_output(layer, out))
    return a.final_logits(hidden)[:, -1]


def _rope_tables(a: DecoderAdapter, batch: Sequence["Decoding"], kvs: Sequence[DecodingKV | None],
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's rotary tables at each request's position, ``[batch, 1, 1, head_dim]`` each: views of the
    requests' own tables, or, for a rotary type without them, computed for this step."""
    rows = [kv.rope(d.position) if kv is not None else None for d, kv in zip(batch, kvs)]
    if any(r is None for r in rows):
        positions = torch.tensor([[d.position] for d in batch], dtype=torch.long, device=like.device)
        return a.rope_tables(*a.rope_cos_sin(like, positions))
    if len(rows) == 1:
        return rows[0]  # type: ignore[return-value]
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])  # type: ignore[index]


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
        self.token = 0  # the pending token: sampled, not yet accepted
        self._token_input: torch.Tensor | None = None  # the same, where the sampler left it (on the device)
        self._draw(blended.logits)
        self.ttft = time.perf_counter() - started
        self.position = self.prompt_tokens  # where the pending token goes, once accepted and fed
        self.tokens: list[int] = []
        self._text = IncrementalText(engine.tokenizer)
        self.emitted = ""
        self.finish: str | None = None
        # Characters that could start a stop string are held back until they cannot.
        self.hold = max((len(s) for s in gen.stop), default=1) - 1
        self.room = max(1, min(gen.max_new_tokens - 1, self.window - self.prompt_tokens))
        self.cache: Any = blended.cache  # the blend's; the model's own forward decodes it without an adapter
        self._kv: DecodingKV | None = None
        # Called by :meth:`settle` once the request has finished, its KV still held (a server keeps the prefix).
        self.on_finish: Callable[["Decoding"], None] | None = None

    @property
    def kv(self) -> DecodingKV | None:
        """The request's decoding KV, set up from the blend's cache at its first step: a blend's layers made
        with room for the answer are taken over as they are, other layers are copied (not before the first
        step, so the first token reaches the caller without waiting for a copy)."""
        if self._kv is None and self.cache is not None and self.engine.adapter is not None:
            self._kv = DecodingKV(self.cache, self.room, self.engine.adapter, self.position)
            self.cache = None
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
        text = self._text.update(self.tokens)
        # Stop strings are found in the decoded text, not by transformers' StopStringCriteria: the answer is cut
        # where one starts and text that could start one is held back, which its yes/no does not say; on SmolLM2
        # it stops where this does but costs ~6x per token and ~0.6 s to build per new list of stop strings
        # (benchmarks/bench_stop_strings.py).
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
        self._draw(logits, self.tokens)
        self.position += 1

    def _draw(self, logits: torch.Tensor, generated: Sequence[int] = ()) -> None:
        sample = getattr(self.sampler, "sample", None)  # looked up each time: a caller may swap the sampler
        if sample is None:  # a sampler that answers with an id only
            self.token, self._token_input = self.sampler(logits, generated), None
            return
        drawn = sample(logits, generated)
        # The one read back from the device a token needs: its id decides end of sequence, stop strings
        # and the text. The next step's input is the tensor itself, so nothing is uploaded again.
        self.token, self._token_input = int(drawn), drawn

    def token_input(self) -> torch.Tensor:
        """The pending token as a step's input ids, ``[1, 1]`` on the device."""
        if self._token_input is None:
            self._token_input = torch.tensor(self.token, dtype=torch.long, device=self.engine.device)
        return self._token_input.view(1, 1)

    def _finish(self, reason: str, text: str | None = None) -> str:
        self.finish = reason
        if text is None:
            text = complete_text(self._text.text)  # the tokens are those of the last accept
        delta = text[len(self.emitted):] if len(text) > len(self.emitted) else ""
        self.emitted = text
        return delta

    def settle(self) -> None:
        """A finished request's last duty, once its last text has gone out: ``on_finish`` (while the KV is still
        held), then the KV dropped. Not part of :meth:`accept`, so that the last token reaches the caller
        without waiting for the bookkeeping: keeping a 3,290-token prompt's K/V in the prefix cache took
        ~65 ms (Qwen2.5-Coder-1.5B, 2-core Xeon), all of it between a one-token answer and its caller."""
        hook, self.on_finish = self.on_finish, None
        if hook is not None:
            hook(self)
        self.release()

    def held_kv(self) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """The token ids whose K/V this request holds (the prompt, then the answer tokens already fed)
        and each layer's keys (rotated) and values, ``[1, kv_heads, >= len(ids), head_dim]``. Nothing
        where a sliding window has dropped the opening tokens from a layer."""
        if self._kv is not None:
            keys, values, lengths = self._kv.keys, self._kv.values, self._kv.lengths
        elif self.cache is not None:
            keys, values = [layer.keys for layer in self.cache.layers], [layer.values for layer in self.cache.layers]
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
