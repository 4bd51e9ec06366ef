"""ChatCacheBlend: a LangChain chat model that answers with CacheBlend.

How a call works:

1. The messages are rendered with the model's chat template into one prompt string.
2. The prompt is split (``cacheblend_rag.prompting``) into the chunk texts this model
   was told about (by :class:`~langchain_cacheblend.CacheBlendRetriever` or
   :meth:`ChatCacheBlend.warm`), found verbatim, and fresh text around them. Where the
   tokenizer allows, the pieces keep the ids the whole prompt tokenizes to, so a blend
   at ratio 1.0 reproduces the plain model exactly.
3. Chunks are looked up in the chunk cache (computed on a miss), blended with
   selective recompute, and the answer is decoded token by token.

With no known chunk in the prompt this is plain full prefill, so the model also
works as an ordinary local chat model.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Iterator, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from cacheblend_rag.concurrency import iterate_in_thread
from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine, build_strategy
from cacheblend_rag.errors import ConfigError, UnsupportedArchitectureError
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.prompting import default_conditioning_prefix, split_prompt, to_segments_in_context
from cacheblend_rag.store import ChunkCache, WarmSummary
from langchain_cacheblend._engines import chunk_cache_for, load_engine, slot_for
from langchain_cacheblend._messages import render_prompt

logger = logging.getLogger(__name__)

# Standard LangChain parameters that only mean something for hosted models.
_HOSTED_ONLY_PARAMS = frozenset({"api_key", "base_url", "max_retries"})
_GENERATION_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
_BLEND_OPTIONS = ("recompute_ratio", "check_layer", "selection", "deviation", "mask", "profile_layers",
                  "profile_tokens")
_CALL_OPTIONS = frozenset({*_GENERATION_OPTIONS, *_BLEND_OPTIONS, "timeout", "model"})


class _RecentTexts:
    """The most recently announced chunk texts, oldest dropped first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, texts: Iterable[str]) -> None:
        with self._lock:
            for text in texts:
                if not text or not text.strip():
                    continue
                self._texts[text] = None
                self._texts.move_to_end(text)
            while len(self._texts) > self.limit:
                self._texts.popitem(last=False)

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._texts)

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()


@dataclass
class _CallSettings:
    generation: GenerationConfig
    blend: BlendConfig
    timeout: float | None


class ChatCacheBlend(BaseChatModel):
    """Local chat model that reuses precomputed KV caches of retrieved chunks (CacheBlend).

    Setup:
        ``pip install -e .[langchain]`` in the cacheblend-rag repository (see its README).

    Key init args (model):
        model: ``"SmolLM2-135M-Instruct"`` (default, embedded and offline), a local model
            folder, a ``.gguf`` file or a hub id. ``"tiny-llama"``, ``"tiny-mistral"``,
            ``"tiny-qwen2"`` and ``"tiny-qwen3"`` name the tiny random models of
            ``cacheblend_rag.testing`` (fast tests; their answers are gibberish).
        engine: an already built ``CacheBlendEngine`` to use instead of loading ``model``.
        store_path: folder of a persistent chunk KV store (any ``cacheblend_rag.store.open_store``
            spec also works, e.g. ``"tiered:PATH"`` or ``"redis://..."``); unset keeps chunk KV
            in memory. Chat models on the same engine and store share one chunk cache.
        device, dtype: where and in what precision to load the model.

    Key init args (blending):
        recompute_ratio, check_layer, selection, deviation, mask, profile_layers, profile_tokens, gate,
        fallback_to_full_prefill: see ``cacheblend_rag.BlendConfig``.
        condition_chunks: precompute chunks behind the chat template's lead and a stand-in
            passage (default ``True``; docs/quality.md).

    Key init args (completion):
        max_tokens, temperature (0 is greedy), top_p, top_k, seed, stop, timeout.

    Instantiate:
        .. code-block:: python

            from langchain_cacheblend import ChatCacheBlend, CacheBlendRetriever

            llm = ChatCacheBlend(recompute_ratio=0.15, max_tokens=64)
            retriever = CacheBlendRetriever(retriever=vectorstore.as_retriever(), llm=llm)

    Invoke:
        .. code-block:: python

            msg = llm.invoke("What is the capital of France?")
            msg.response_metadata["ttft_s"], msg.response_metadata["reused_tokens"]

    Every call (also per call through ``bind``) accepts ``max_tokens``, ``temperature``,
    ``top_p``, ``top_k``, ``seed``, ``timeout`` and the blending options above.
    ``response_metadata`` carries the blend stats (``ttft_s``, ``mode``, ``cached_tokens``,
    ``reused_tokens``, ``recomputed_tokens``, ``fresh_tokens``, ``cache_hits``,
    ``cache_misses``, ``timings``; ``total_tokens`` there counts prompt tokens) and
    ``usage_metadata`` counts tokens, with ``input_token_details["cache_read"]`` the prompt
    tokens whose cached KV was reused as is.

    ``api_key``, ``base_url`` and ``max_retries``, standard parameters of hosted models, are
    accepted and ignored; any other unknown argument is an error.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    model: str = DEFAULT_MODEL_NAME
    """Model to load: the default embedded SmolLM2, a folder, a .gguf file, a hub id or ``tiny-<arch>``."""
    engine: CacheBlendEngine | None = Field(default=None, exclude=True, repr=False)
    """An engine built by the caller; ``model`` then defaults to its name."""
    store_path: str | None = None
    """Folder of a persistent chunk KV store (or an ``open_store`` spec); ``None`` keeps chunk KV in memory."""
    device: str | None = None
    dtype: str | None = None

    recompute_ratio: float = BlendConfig.recompute_ratio
    check_layer: int | None = BlendConfig.check_layer
    """``None`` takes the selection strategy's own check layer."""
    selection: str = BlendConfig.selection
    deviation: Literal["value", "key"] = BlendConfig.deviation
    mask: Literal["exact", "bottom_right"] = BlendConfig.mask
    profile_layers: int | None = BlendConfig.profile_layers
    """Layers ``query_profiled``'s profiling pass runs; ``None``: all. Fewer is cheaper and chooses worse."""
    profile_tokens: int | None = BlendConfig.profile_tokens
    """The question's last tokens ``query_profiled``'s profiling pass runs; ``None``: the whole question."""
    gate: bool = BlendConfig.gate
    fallback_to_full_prefill: bool = BlendConfig.fallback_to_full_prefill
    condition_chunks: bool = True
    """Precompute chunks behind the chat template's lead and a stand-in passage (measured better
    than computing each alone, docs/quality.md); ``False`` computes each chunk on its own."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    timeout: float | None = None
    """Seconds one call may take, checked as tokens are decoded; a longer call raises ``TimeoutError``."""
    streaming: bool = False
    """Generate through the streaming path on ``invoke`` too (token callbacks fire)."""
    max_known_chunks: int = Field(default=4096, ge=1)
    """How many announced chunk texts to remember (most recent first)."""

    _known_chunks: _RecentTexts = PrivateAttr()
    _loaded_engine: CacheBlendEngine | None = PrivateAttr(default=None)

    # ---------------------------------------------------------------- validation
    @model_validator(mode="before")
    @classmethod
    def _check_init_args(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = {k: v for k, v in values.items() if k not in _HOSTED_ONLY_PARAMS}
        allowed = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = sorted(set(values) - allowed)
        if unknown:
            hints = [
                f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, allowed, 1)) else repr(name)
                for name in unknown
            ]
            raise ValueError(f"ChatCacheBlend got unknown argument(s) {', '.join(hints)}")
        engine = values.get("engine")
        if engine is not None and "model" not in values:
            values["model"] = engine.model_name
        return values

    @field_validator("store_path")
    @classmethod
    def _check_store_path(cls, value: str | None) -> str | None:
        if value is None or "://" in value or value.split(":", 1)[0] in ("memory", "tiered", "disk"):
            return value
        folder = Path(value).expanduser()
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            what = "is not a folder" if not existing.is_dir() else "is not writable"
            raise ValueError(
                f"store_path={value!r} cannot hold a chunk KV store: {existing} {what}; pass a folder this "
                "process can create and write, or store_path=None to keep chunk KV in memory"
            )
        return str(folder)

    @model_validator(mode="after")
    def _check_settings(self) -> "ChatCacheBlend":
        # Build the configs once so a bad value fails here, with the config's own message.
        build_strategy(self._blend_config({}))
        self._generation_config({}, None)
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigError(f"timeout={self.timeout!r} must be a positive number of seconds, or None")
        return self

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        self._known_chunks = _RecentTexts(self.max_known_chunks)

    # ------------------------------------------------------------- LangChain glue
    @property
    def _llm_type(self) -> str:
        return "cacheblend-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "store_path": self.store_path,
            **{name: getattr(self, name) for name in (*_BLEND_OPTIONS, *_GENERATION_OPTIONS)},
            "stop": self.stop,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        model = kwargs.get("model")
        params = LangSmithParams(
            ls_provider="cacheblend",
            ls_model_name=model if isinstance(model, str) else self.model,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens:
            params["ls_max_tokens"] = max_tokens
        stop = stop if stop is not None else self.stop
        if stop:
            params["ls_stop"] = stop
        return params

    # ------------------------------------------------------------------ engine
    def get_engine(self) -> CacheBlendEngine:
        """The engine, loaded on first use (shared with other chat models naming the same model)."""
        if self.engine is not None:
            return self.engine
        if self._loaded_engine is None:
            engine = load_engine(self.model, device=self.device, dtype=self.dtype)
            if engine.adapter is None and not self.fallback_to_full_prefill:
                raise UnsupportedArchitectureError(
                    f"{engine.unsupported_reason}; set fallback_to_full_prefill=True to serve this model "
                    "with full prefill (no KV reuse)"
                )
            self._loaded_engine = engine
        return self._loaded_engine

    @property
    def chunk_cache(self) -> ChunkCache:
        """The chunk KV cache this model reads (and fills on a miss)."""
        engine = self.get_engine()
        prefix = tuple(default_conditioning_prefix(engine.tokenizer)) if self.condition_chunks else ()
        return chunk_cache_for(engine, self.store_path, prefix)

    @property
    def known_chunk_texts(self) -> list[str]:
        """Chunk texts this model looks for in its prompts, oldest first."""
        return self._known_chunks.snapshot()

    def announce_chunks(self, texts: Iterable[str | Document]) -> None:
        """Tell the model that coming prompts may contain these chunk texts verbatim."""
        self._known_chunks.add(_texts_of(texts))

    def forget_chunks(self) -> None:
        """Stop looking for any announced chunk text (cached KV stays in the chunk cache)."""
        self._known_chunks.clear()

    def warm(self, items: Iterable[str | Document], *, show_progress: bool = True) -> WarmSummary:
        """Precompute the KV of chunks not yet cached, and announce them all."""
        texts = _texts_of(items)
        engine = self.get_engine()
        with slot_for(engine).lock:
            summary = self.chunk_cache.warm(texts, show_progress=show_progress)
        self.announce_chunks(texts)
        return summary

    # ---------------------------------------------------------------- settings
    def _blend_config(self, options: dict[str, Any]) -> BlendConfig:
        return BlendConfig(
            **{name: options.get(name, getattr(self, name)) for name in _BLEND_OPTIONS},
            gate=self.gate,
            fallback_to_full_prefill=self.fallback_to_full_prefill,
        )

    def _generation_config(self, options: dict[str, Any], stop: list[str] | None) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=options.get("max_tokens", self.max_tokens),
            temperature=options.get("temperature", self.temperature),
            top_p=options.get("top_p", self.top_p),
            top_k=options.get("top_k", self.top_k),
            seed=options.get("seed", self.seed),
            stop=tuple(stop if stop is not None else (self.stop or ())),
        )

    def _call_settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> _CallSettings:
        # LangChain passes its own tracing keys (ls_*) and `stream` along with user options.
        options = {k: v for k, v in kwargs.items() if not k.startswith("ls_") and k != "stream"}
        unknown = sorted(set(options) - _CALL_OPTIONS)
        if unknown:
            raise ValueError(
                f"ChatCacheBlend got unknown call option(s) {unknown}; allowed: {sorted(_CALL_OPTIONS)}"
            )
        model = options.get("model")
        if model is not None and model != self.model:
            raise ValueError(
                f"this ChatCacheBlend serves {self.model!r} and cannot switch to model={model!r} per call; "
                f"create ChatCacheBlend(model={model!r}) instead"
            )
        timeout = options.get("timeout", self.timeout)
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds, or None")
        return _CallSettings(self._generation_config(options, stop), self._blend_config(options), timeout)

    # -------------------------------------------------------------- generation
    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # Token callbacks are fired by BaseChatModel for every chunk yielded here.
        settings = self._call_settings(stop, kwargs)
        engine = self.get_engine()
        cache = self.chunk_cache
        started = time.perf_counter()
        with slot_for(engine).lock:
            prompt = render_prompt(engine.tokenizer, messages)
            split = split_prompt(prompt, self._known_chunks.snapshot())
            segments = to_segments_in_context(split, engine.tokenizer, cache.prefix_ids)
            stream = engine.stream(segments, settings.generation, config=settings.blend, store=cache)
            deltas = iter(stream)
            try:
                for delta in deltas:
                    if settings.timeout is not None and time.perf_counter() - started > settings.timeout:
                        raise TimeoutError(f"generation took longer than timeout={settings.timeout}s")
                    yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
                result = stream.result()
            finally:
                close = getattr(deltas, "close", None)
                if close is not None:
                    close()
        stats = result.stats_dict()
        usage = UsageMetadata(
            input_tokens=result.prompt_tokens,
            output_tokens=result.completion_tokens,
            total_tokens=result.prompt_tokens + result.completion_tokens,
            input_token_details=InputTokenDetails(cache_read=result.stats.reused_tokens),
        )
        metadata = {"model_name": self.model, "model_provider": "cacheblend", **stats,
                    "chunks_in_prompt": len(split.found)}
        yield ChatGenerationChunk(
            message=AIMessageChunk(
                content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last"
            ),
            generation_info={"finish_reason": result.finish_reason},
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # One code path for invoke and stream, so both give the same answer and stats.
        return generate_from_stream(self._stream(messages, stop=stop, **kwargs))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # The engine computes on a worker thread so the event loop stays free. Leaving early
        # stops the decode at its next token.
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop=stop, **kwargs)):
            yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop=stop, **kwargs))


def _texts_of(items: Iterable[str | Document]) -> list[str]:
    texts: list[str] = []
    for item in items:
        if isinstance(item, Document):
            texts.append(item.page_content)
        elif isinstance(item, str):
            texts.append(item)
        else:
            raise TypeError(f"expected chunk texts or Documents, got {type(item).__name__}")
    return texts


__all__ = ["ChatCacheBlend"]
