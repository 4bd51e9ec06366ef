"""CacheBlendLLM: a LlamaIndex LLM that answers RAG prompts from precomputed chunk KV caches.

A query engine hands the LLM one flat prompt string. Beforehand, the
``CacheBlendNodePostprocessor`` (``llama-index-postprocessor-cacheblend``) has announced the
retrieved chunk texts and made sure their KV is in the chunk store. The LLM renders chat
messages with the tokenizer's chat template and hands the prompt to the core's serving layer
(:class:`cacheblend_rag.serving.BlendService`), which finds every announced chunk verbatim,
blends their cached KV with selective recompute and decodes. A prompt with no announced chunk
in it is answered by plain full prefill, and the stats say so. Each response carries the
stats in ``additional_kwargs`` (and ``raw``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence

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
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from cacheblend_rag.concurrency import iterate_in_thread
from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.serving import BLEND_FIELDS, CacheBlendSettings, Served
from cacheblend_rag.store import ChunkCache

logger = logging.getLogger(__name__)

_GENERATION_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


class CacheBlendLLM(CustomLLM, CacheBlendSettings):
    """A local model that reuses precomputed chunk KV caches (CacheBlend) for RAG prompts.

    >>> llm = CacheBlendLLM()                        # embedded SmolLM2-135M-Instruct, KV in memory
    >>> query_engine = index.as_query_engine(
    ...     llm=llm, node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])

    The model, store and blending fields are shared with LangChain's ``ChatCacheBlend``
    (:class:`cacheblend_rag.serving.CacheBlendSettings`). Set ``reuse_chunk_kv=False`` for the
    same model with plain full prefill (a baseline).
    """

    # --- generation defaults (each call may override them as keyword arguments)
    max_new_tokens: int = Field(default=256, description="Most tokens generated per answer.")
    temperature: float = Field(default=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(default=0, description="Top-k sampling; 0 turns it off.")
    seed: Optional[int] = Field(default=None, description="Sampling seed, for reproducible sampled answers.")
    stop: List[str] = Field(default_factory=list, description="Strings that end the answer.")

    # --- LlamaIndex behaviour
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

    _custom_messages_to_prompt: bool = PrivateAttr(default=False)
    _custom_completion_to_prompt: bool = PrivateAttr(default=False)
    _last_prompt: Optional[str] = PrivateAttr(default=None)
    _last_stats: Optional[Dict[str, Any]] = PrivateAttr(default=None)

    def __init__(self, **kwargs: Any) -> None:
        """``engine=`` and ``chunk_cache=`` let several LLMs share one loaded model and one store."""
        custom_messages = kwargs.get("messages_to_prompt") is not None
        custom_completion = kwargs.get("completion_to_prompt") is not None
        super().__init__(**kwargs)
        self._custom_messages_to_prompt = custom_messages
        self._custom_completion_to_prompt = custom_completion

    @classmethod
    def from_engine(
        cls, engine: CacheBlendEngine, *, chunk_cache: Optional[ChunkCache] = None, **kwargs: Any
    ) -> "CacheBlendLLM":
        """Wrap an engine that is already loaded (tests, or several LLMs over one model)."""
        return cls(engine=engine, chunk_cache=chunk_cache, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendLLM"

    def _validate_settings(self) -> None:
        self.generation_config  # a bad value fails here, before the model is loaded

    @property
    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=tuple(self.stop),
        )

    # ------------------------------------------------------------ properties
    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self.engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._is_chat,
            model_name=self.engine.model_name,
        )

    @property
    def _is_chat(self) -> bool:
        if self.is_chat_model is not None:
            return self.is_chat_model
        return bool(getattr(self.engine.tokenizer, "chat_template", None))

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
        return self.service.announce(texts)

    def forget_chunks(self) -> None:
        """Drop every announced chunk text (the stored KV stays)."""
        self.service.announced.clear()

    def precompute(self, texts: Sequence[str], *, show_progress: bool = False) -> Any:
        """Compute and store the KV of each chunk text that the store lacks; returns the store's summary."""
        return self.service.warm(texts, show_progress=show_progress)

    # ------------------------------------------------------------ prompting
    def _render_messages(self, messages: Sequence[ChatMessage]) -> str:
        tokenizer = self.engine.tokenizer
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

    def _call_configs(self, kwargs: Dict[str, Any]) -> tuple:
        """The generation and blend configs of one call: the fields, overridden by its keyword arguments."""
        overrides = {k: kwargs[k] for k in _GENERATION_KEYS if kwargs.get(k) is not None}
        if kwargs.get("max_tokens") is not None and "max_new_tokens" not in overrides:
            overrides["max_new_tokens"] = kwargs["max_tokens"]
        if isinstance(overrides.get("stop"), list):
            overrides["stop"] = tuple(overrides["stop"])
        base = self.generation_config
        generation = GenerationConfig(**{**{k: getattr(base, k) for k in _GENERATION_KEYS}, **overrides})
        blend = self.blend_config_with({k: kwargs[k] for k in BLEND_FIELDS if k in kwargs})
        return generation, blend

    # ------------------------------------------------------------ generation
    def _generate(self, prompt: str, kwargs: Dict[str, Any]) -> CompletionResponse:
        generation, blend = self._call_configs(kwargs)
        served = self.service.generate(prompt, generation, blend, reuse=self.reuse_chunk_kv)
        return self._finish(prompt, served, text=served.result.text, delta=None)

    def _generate_stream(self, prompt: str, kwargs: Dict[str, Any]) -> Iterator[CompletionResponse]:
        """Yields a response per text delta; the last one carries the stats.

        One delta is held back so the stats can ride on the final delta instead of an empty
        extra response.
        """
        generation, blend = self._call_configs(kwargs)
        text, held = "", None
        stream = self.service.stream(prompt, generation, blend, reuse=self.reuse_chunk_kv)
        try:
            for delta in stream:
                if held is not None:
                    text += held
                    yield CompletionResponse(text=text, delta=held)
                held = delta
            served = stream.result()
        finally:
            stream.close()
        last = held or ""
        yield self._finish(prompt, served, text=text + last, delta=last)

    def _finish(self, prompt: str, served: Served, *, text: str, delta: Optional[str]) -> CompletionResponse:
        stats = served.stats()
        self._last_prompt, self._last_stats = prompt, stats
        raw = {"stats": stats, "prompt": prompt, "token_ids": list(served.result.token_ids)}
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
