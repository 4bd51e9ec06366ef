"""CacheBlendLLM: a LlamaIndex LLM that answers RAG prompts from precomputed chunk KV caches.

A query engine hands the LLM one flat prompt string. Beforehand, the
:class:`~llama_index.postprocessor.cacheblend.CacheBlendNodePostprocessor` has
announced the retrieved chunk texts (as the engine renders them) and made sure
their KV is in the chunk store. The LLM then:

1. renders chat messages with the tokenizer's chat template (for chat models), so the
   system/user openers and the assistant start are plain text around the context;
2. finds every announced chunk text verbatim in the prompt
   (:func:`cacheblend_rag.prompting.split_prompt`); everything else, i.e. template
   text, glue, the question and chunks that were changed on the way, is fresh text;
3. tokenizes each piece on its own, so a chunk's tokens are exactly those its KV
   was computed for, and blends (CacheBlend selective recompute) and decodes.

A prompt with no announced chunk in it is answered by plain full prefill, and the
stats say so. Each response carries the stats in ``additional_kwargs`` (and ``raw``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from cacheblend_rag.concurrency import iterate_in_thread
from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine, FreshSegment, build_strategy
from cacheblend_rag.engine.generate import GenerationResult
from cacheblend_rag.prompting import default_conditioning_prefix, split_prompt, to_segments
from cacheblend_rag.store import ChunkCache, parse_size

from llama_index.llms.cacheblend.runtime import AnnouncedChunks, engine_lock, open_chunk_cache

logger = logging.getLogger(__name__)

_BLEND = BlendConfig()  # field defaults come from the engine's own config
_GENERATION_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


class CacheBlendLLM(CustomLLM):
    """A local model that reuses precomputed chunk KV caches (CacheBlend) for RAG prompts.

    >>> llm = CacheBlendLLM()                        # embedded SmolLM2-135M-Instruct, KV in memory
    >>> query_engine = index.as_query_engine(
    ...     llm=llm, node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])

    Set ``reuse_chunk_kv=False`` for the same model with plain full prefill (a baseline).
    """

    # --- which model and where chunk KV lives
    model: Optional[str] = Field(
        default=None,
        description="Model folder, .gguf file or hub id; None for the embedded SmolLM2-135M-Instruct.",
    )
    store_path: Optional[str] = Field(
        default=None, description="Folder of the persistent chunk KV store; None keeps chunk KV in memory."
    )
    store_size_limit: Optional[Union[int, str]] = Field(
        default=None, description="Bound on the store's size in bytes or with a unit ('2GB'); None: unbounded."
    )
    device: Optional[str] = Field(default=None, description="Torch device; None picks CUDA when available.")
    dtype: Optional[str] = Field(default=None, description="float32, bfloat16 or float16; None picks per device.")

    # --- BlendConfig (see cacheblend_rag.config.BlendConfig for their meaning)
    recompute_ratio: float = Field(default=_BLEND.recompute_ratio, description="Share of cached tokens recomputed.")
    check_layer: Optional[int] = Field(
        default=_BLEND.check_layer,
        description="Layer where the tokens to recompute are chosen; None takes the selection strategy's own.",
    )
    deviation: str = Field(default=_BLEND.deviation, description="'value' or 'key' deviation ranks tokens.")
    mask: str = Field(default=_BLEND.mask, description="'exact' or 'bottom_right' attention mask for recompute.")
    selection: str = Field(default=_BLEND.selection, description="Registered token-selection strategy.")
    sink_tokens: int = Field(default=_BLEND.sink_tokens, description="Tokens at each chunk start always kept.")
    query_weight: float = Field(default=_BLEND.query_weight, description="Weight of query attention in selection.")
    gradual_expand: float = Field(default=_BLEND.gradual_expand, description="Gradual filtering expansion factor.")
    profile_layers: Optional[int] = Field(
        default=_BLEND.profile_layers,
        description="Layers query_profiled's profiling pass runs; None: all (fewer is cheaper and chooses worse).",
    )
    profile_tokens: Optional[int] = Field(
        default=_BLEND.profile_tokens,
        description="The question's last tokens query_profiled's profiling pass runs; None: the whole question.",
    )
    gate: bool = Field(default=_BLEND.gate, description="Check once per model that ratio 1.0 equals full prefill.")
    condition_chunks: bool = Field(
        default=True,
        description="Precompute chunks behind the chat template's lead and a stand-in passage (measured better "
        "than computing each alone, docs/quality.md); False computes each chunk on its own.",
    )
    gate_tolerance: Optional[float] = Field(default=_BLEND.gate_tolerance, description="Gate tolerance override.")
    fallback_to_full_prefill: bool = Field(
        default=_BLEND.fallback_to_full_prefill,
        description="Serve with full prefill when the architecture is unsupported or the gate fails.",
    )

    # --- generation defaults (each call may override them as keyword arguments)
    max_new_tokens: int = Field(default=256, description="Most tokens generated per answer.")
    temperature: float = Field(default=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(default=0, description="Top-k sampling; 0 turns it off.")
    seed: Optional[int] = Field(default=None, description="Sampling seed, for reproducible sampled answers.")
    stop: List[str] = Field(default_factory=list, description="Strings that end the answer.")

    # --- integration behaviour
    reuse_chunk_kv: bool = Field(
        default=True, description="False answers every prompt by full prefill of the whole prompt (a baseline)."
    )
    max_announced_chunks: int = Field(
        default=2048, ge=1, description="How many announced chunk texts are remembered (least recent dropped)."
    )
    context_window: Optional[int] = Field(
        default=None, description="Prompt + answer tokens; None takes the model's maximum position."
    )
    is_chat_model: Optional[bool] = Field(
        default=None, description="Render chat messages with the tokenizer's chat template; None: if it has one."
    )
    chat_template_for_completions: bool = Field(
        default=True,
        description="complete() on a chat model wraps an unformatted prompt as one user turn of the chat template.",
    )

    _engine: CacheBlendEngine = PrivateAttr()
    _chunk_cache: ChunkCache = PrivateAttr()
    _announced: AnnouncedChunks = PrivateAttr()
    _custom_messages_to_prompt: bool = PrivateAttr(default=False)
    _custom_completion_to_prompt: bool = PrivateAttr(default=False)
    _last_prompt: Optional[str] = PrivateAttr(default=None)
    _last_stats: Optional[Dict[str, Any]] = PrivateAttr(default=None)

    def __init__(
        self,
        engine: Optional[CacheBlendEngine] = None,
        chunk_cache: Optional[ChunkCache] = None,
        **kwargs: Any,
    ) -> None:
        """``engine`` and ``chunk_cache`` let several LLMs share one loaded model and one store."""
        custom_messages = kwargs.get("messages_to_prompt") is not None
        custom_completion = kwargs.get("completion_to_prompt") is not None
        if engine is not None and kwargs.get("model") is None:
            kwargs["model"] = engine.model_name
        super().__init__(**kwargs)
        self._custom_messages_to_prompt = custom_messages
        self._custom_completion_to_prompt = custom_completion
        if engine is None:
            engine = CacheBlendEngine.from_pretrained(
                self.model, config=self.blend_config, device=self.device, dtype=self.dtype
            )
        elif engine.adapter is not None:
            engine.plan(self.blend_config)
        self._engine = engine
        if chunk_cache is not None and chunk_cache.engine is not engine:
            raise ValueError("chunk_cache belongs to another engine; build it with ChunkCache(this engine, ...)")
        prefix = default_conditioning_prefix(engine.tokenizer) if self.condition_chunks else ()
        self._chunk_cache = chunk_cache if chunk_cache is not None else open_chunk_cache(
            engine, self.store_path, self.store_size_limit, prefix_ids=prefix
        )
        self._announced = AnnouncedChunks(self.max_announced_chunks)

    @classmethod
    def from_engine(
        cls, engine: CacheBlendEngine, *, chunk_cache: Optional[ChunkCache] = None, **kwargs: Any
    ) -> "CacheBlendLLM":
        """Wrap an engine that is already loaded (tests, or several LLMs over one model)."""
        return cls(engine=engine, chunk_cache=chunk_cache, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendLLM"

    # ------------------------------------------------------------ validation
    @field_validator("store_path")
    @classmethod
    def _store_path_is_writable(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return None
        path = Path(os.fspath(value)).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            reason = exc.strerror or exc.__class__.__name__
            raise ValueError(
                f"store_path={str(value)!r} cannot be used as a chunk KV store ({reason}); pass a folder "
                "this process can create and write, or store_path=None to keep chunk KV in memory"
            ) from None
        return str(path)

    @field_validator("store_size_limit")
    @classmethod
    def _size_limit_is_understood(cls, value: Optional[Union[int, str]]) -> Optional[Union[int, str]]:
        if value is not None and parse_size(value) < 1:
            raise ValueError(f"store_size_limit={value!r} must be a positive size, e.g. 2GB, or None for no bound")
        return value

    @model_validator(mode="after")
    def _configs_are_valid(self) -> "CacheBlendLLM":
        # ConfigError is a ValueError, so pydantic reports it with the field, value and allowed range.
        build_strategy(self.blend_config)
        self.generation_config
        return self

    @property
    def blend_config(self) -> BlendConfig:
        return BlendConfig(
            recompute_ratio=self.recompute_ratio, check_layer=self.check_layer, deviation=self.deviation,  # type: ignore[arg-type]
            mask=self.mask, selection=self.selection, sink_tokens=self.sink_tokens,  # type: ignore[arg-type]
            query_weight=self.query_weight, gradual_expand=self.gradual_expand, profile_layers=self.profile_layers,
            profile_tokens=self.profile_tokens, gate=self.gate,
            gate_tolerance=self.gate_tolerance, fallback_to_full_prefill=self.fallback_to_full_prefill,
        )

    @property
    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=tuple(self.stop),
        )

    # ------------------------------------------------------------ properties
    @property
    def engine(self) -> CacheBlendEngine:
        return self._engine

    @property
    def chunk_cache(self) -> ChunkCache:
        return self._chunk_cache

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self._engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._is_chat,
            model_name=self._engine.model_name,
        )

    @property
    def _is_chat(self) -> bool:
        if self.is_chat_model is not None:
            return self.is_chat_model
        return bool(getattr(self._engine.tokenizer, "chat_template", None))

    @property
    def last_prompt(self) -> Optional[str]:
        """The rendered prompt string of the most recent call (after chat templating)."""
        return self._last_prompt

    @property
    def last_stats(self) -> Optional[Dict[str, Any]]:
        """The stats of the most recent finished call (also in each response's ``additional_kwargs``)."""
        return self._last_stats

    # ------------------------------------------------------- chunk handling
    def announce_chunks(self, texts: Sequence[str]) -> List[str]:
        """Tell the LLM which chunk texts the coming prompts will contain (the postprocessor does this)."""
        return self._announced.announce(texts)

    def forget_chunks(self) -> None:
        """Drop every announced chunk text (the stored KV stays)."""
        self._announced.clear()

    def precompute(self, texts: Sequence[str], *, show_progress: bool = False) -> Any:
        """Compute and store the KV of each chunk text that the store lacks; returns the store's summary."""
        kept = [t.strip() for t in texts if t and t.strip()]
        with engine_lock(self._engine):
            return self._chunk_cache.warm(kept, show_progress=show_progress)

    # ------------------------------------------------------------ prompting
    def _render_messages(self, messages: Sequence[ChatMessage]) -> str:
        tokenizer = self._engine.tokenizer
        if self._custom_messages_to_prompt or not getattr(tokenizer, "chat_template", None):
            return self.messages_to_prompt(messages)
        turns = [{"role": _role_name(m.role), "content": m.content or ""} for m in messages]
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)

    def _format_completion(self, prompt: str, formatted: bool) -> str:
        if formatted:
            return prompt
        if self._custom_completion_to_prompt or not (self._is_chat and self.chat_template_for_completions):
            return self.completion_to_prompt(prompt)
        return self._render_messages([ChatMessage(role=MessageRole.USER, content=prompt)])

    def _segments(self, prompt: str) -> tuple[list, Dict[str, Any]]:
        """Split the prompt into cached chunks and fresh text, with what was found for the stats."""
        tokenize = self._engine.tokenize
        latest = self._announced.latest()
        if not self.reuse_chunk_kv:
            info = {"chunks_found": 0, "chunks_missing": 0, "reason": "chunk KV reuse is off (reuse_chunk_kv=False)"}
            return [FreshSegment(tokenize(prompt))], info
        split = split_prompt(prompt, self._announced.known())
        segments = to_segments(split, tokenize, self._chunk_cache.prefix_ids)
        found = set(split.found)
        info = {
            "chunks_found": len(split.found),
            # Chunks of the latest retrieval that this prompt lacks verbatim (changed by a template,
            # truncated, or, in refine mode, simply handled by another LLM call).
            "chunks_missing": sum(1 for text in latest if text not in found),
            "reason": None if split.found else "no announced chunk text appears verbatim in the prompt",
        }
        return segments, info

    def _generation_overrides(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        overrides = {k: kwargs[k] for k in _GENERATION_KEYS if kwargs.get(k) is not None}
        if kwargs.get("max_tokens") is not None and "max_new_tokens" not in overrides:
            overrides["max_new_tokens"] = kwargs["max_tokens"]
        if isinstance(overrides.get("stop"), list):
            overrides["stop"] = tuple(overrides["stop"])
        return overrides

    def _stats(self, result: GenerationResult, info: Dict[str, Any]) -> Dict[str, Any]:
        stats = result.stats_dict()
        stats["chunks_found"] = info["chunks_found"]
        stats["chunks_missing"] = info["chunks_missing"]
        stats["recompute_ratio"] = self.recompute_ratio
        stats["model"] = self._engine.model_name
        if stats.get("fallback_reason") is None and stats["mode"] == "full_prefill":
            stats["fallback_reason"] = info["reason"]
        return stats

    # ------------------------------------------------------------ generation
    def _generate(self, prompt: str, kwargs: Dict[str, Any]) -> CompletionResponse:
        overrides = self._generation_overrides(kwargs)
        with engine_lock(self._engine):
            segments, info = self._segments(prompt)
            result = self._engine.generate(
                segments, self.generation_config, config=self.blend_config, store=self._chunk_cache, **overrides
            )
        return self._finish(prompt, result, info, text=result.text, delta=None)

    def _generate_stream(self, prompt: str, kwargs: Dict[str, Any]) -> Iterator[CompletionResponse]:
        """Yields a response per text delta; the last one carries the stats.

        One delta is held back so the stats can ride on the final delta instead of an empty
        extra response.
        """
        overrides = self._generation_overrides(kwargs)
        text, held = "", None
        with engine_lock(self._engine):
            segments, info = self._segments(prompt)
            stream = self._engine.stream(
                segments, self.generation_config, config=self.blend_config, store=self._chunk_cache, **overrides
            )
            for delta in stream:
                if held is not None:
                    text += held
                    yield CompletionResponse(text=text, delta=held)
                held = delta
            result = stream.result()
        last = held or ""
        yield self._finish(prompt, result, info, text=text + last, delta=last)

    def _finish(
        self, prompt: str, result: GenerationResult, info: Dict[str, Any], *, text: str, delta: Optional[str]
    ) -> CompletionResponse:
        stats = self._stats(result, info)
        self._last_prompt, self._last_stats = prompt, stats
        raw = {"stats": stats, "prompt": prompt, "token_ids": list(result.token_ids)}
        return CompletionResponse(text=text, delta=delta, additional_kwargs=stats, raw=raw)

    # ------------------------------------------------------ LlamaIndex API
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._generate(self._format_completion(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._generate_stream(self._format_completion(prompt, formatted), kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _as_chat(self._generate(self._render_messages(messages), kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt = self._render_messages(messages)
        return (_as_chat(r) for r in self._generate_stream(prompt, kwargs))

    # Async: the engine runs in a worker thread, so the event loop stays free.
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._generate, self._format_completion(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        prompt = self._format_completion(prompt, formatted)
        return iterate_in_thread(lambda: self._generate_stream(prompt, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = await asyncio.to_thread(self._generate, self._render_messages(messages), kwargs)
        return _as_chat(response)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt = self._render_messages(messages)

        async def gen() -> ChatResponseAsyncGen:
            async for response in iterate_in_thread(lambda: self._generate_stream(prompt, kwargs)):
                yield _as_chat(response)

        return gen()


def _role_name(role: Any) -> str:
    return role.value if isinstance(role, MessageRole) else str(role)


def _as_chat(response: CompletionResponse) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
        delta=response.delta,
        additional_kwargs=response.additional_kwargs,
        raw=response.raw,
    )


__all__ = ["CacheBlendLLM"]
