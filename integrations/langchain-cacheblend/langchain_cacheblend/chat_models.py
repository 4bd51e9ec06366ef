"""ChatCacheBlend: a LangChain chat model that answers with CacheBlend.

How a call works:

1. The messages are rendered with the model's chat template into one prompt string.
2. The core's serving layer (:class:`cacheblend_rag.serving.BlendService`, shared with the
   LlamaIndex integration) finds the chunk texts this model was told about (by
   :class:`~langchain_cacheblend.CacheBlendRetriever` or :meth:`ChatCacheBlend.warm`) verbatim,
   looks them up in the chunk cache (computed on a miss), blends with selective recompute,
   and decodes token by token. Where the tokenizer allows, the pieces keep the ids the whole
   prompt tokenizes to, so a blend at ratio 1.0 reproduces the plain model exactly.

With no known chunk in the prompt this is plain full prefill, so the model also
works as an ordinary local chat model.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, ClassVar, Iterable, Iterator, Literal, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.language_models import LanguageModelInput, ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolCallChunk
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

from cacheblend_rag.concurrency import iterate_in_thread
from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.serving import BLEND_FIELDS, SAMPLING_FIELDS, CacheBlendSettings, unknown_names_error
from cacheblend_rag.serving.answer_stream import AnswerStream
from cacheblend_rag.serving.tool_stream import ToolCallStream
from cacheblend_rag.serving.tool_formats import tool_format
from cacheblend_rag.serving.tools import chosen_tools, constrained, tool_functions
from cacheblend_rag.store import WarmSummary
from langchain_cacheblend._messages import render_prompt, text_chunk, texts_of
from langchain_cacheblend._profile import model_profile
from langchain_cacheblend._structured import json_structured_output
from langchain_cacheblend._tool_results import tool_result_documents

logger = logging.getLogger(__name__)

_GENERATION_OPTIONS = ("max_tokens", *SAMPLING_FIELDS)
_CALL_OPTIONS = frozenset({*_GENERATION_OPTIONS, *BLEND_FIELDS, "timeout", "model", "tools", "tool_choice",
                           "parallel_tool_calls", "response_format", "generate_kwargs", "pipeline_kwargs"})


@dataclass
class _CallSettings:
    generation: GenerationConfig
    blend: BlendConfig
    timeout: float | None
    tools: list[dict[str, Any]]  # the functions a call may use ([]: none)
    tool_required: bool
    parallel_tool_calls: bool  # False: only the first of several calls in one answer is kept


class ChatCacheBlend(BaseChatModel, CacheBlendSettings):
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
        chat_template_kwargs: variables of the chat template (``{"enable_thinking": False}`` for Qwen3).

    Key init args (blending):
        recompute_ratio, check_layer, selection, deviation, mask, profile_layers, profile_tokens, gate,
        fallback_to_full_prefill: see ``cacheblend_rag.BlendConfig``.
        condition_chunks: precompute chunks behind the chat template's lead and a stand-in
            passage (default ``True``; docs/quality.md).

    Key init args (completion):
        max_tokens, temperature (0 is greedy; unset: the model's generation config), top_p, top_k,
        min_p, repetition_penalty, seed, stop, timeout; generate_kwargs (model.generate's keyword
        arguments, as HuggingFacePipeline takes them; also per call).

    Instantiate:
        .. code-block:: python

            from langchain_cacheblend import ChatCacheBlend, CacheBlendRetriever

            llm = ChatCacheBlend(recompute_ratio=0.15, max_tokens=64)
            retriever = CacheBlendRetriever(retriever=vectorstore.as_retriever(), llm=llm)

    Invoke:
        .. code-block:: python

            msg = llm.invoke("What is the capital of France?")
            stats = msg.response_metadata["cacheblend"]
            stats["ttft_s"], stats["reused_tokens"]

    Every call (also per call through ``bind``) accepts ``max_tokens``, the sampling options,
    ``timeout`` and the blending options above.
    ``response_metadata["cacheblend"]`` carries the blend stats (``ttft_s``, ``mode``, ``cached_tokens``,
    ``reused_tokens``, ``recomputed_tokens``, ``fresh_tokens``, ``cache_hits``,
    ``cache_misses``, ``timings``; ``total_tokens`` there counts prompt tokens) and
    ``usage_metadata`` counts tokens, with ``input_token_details["cache_read"]`` the prompt
    tokens whose cached KV was reused as is.

    ``api_key``, ``base_url`` and ``max_retries``, standard parameters of hosted models, are
    accepted and ignored; any other unknown argument is an error.
    """

    # Standard parameters of hosted models: accepted, and they mean nothing for a local model.
    _ignored_init_args: ClassVar[frozenset[str]] = frozenset({"api_key", "base_url", "max_retries"})

    _max_tokens_field: ClassVar[str] = "max_tokens"

    max_tokens: int = 256
    stop: list[str] | None = None
    timeout: float | None = None
    """Seconds one call may take, checked as tokens are decoded; a longer call raises ``TimeoutError``."""
    streaming: bool = False
    """Generate through the streaming path on ``invoke`` too (token callbacks fire)."""

    def _validate_settings(self) -> None:
        # Build the configs once so a bad value fails here, with the config's own message.
        self._generation_config({}, None)
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigError(f"timeout={self.timeout!r} must be a positive number of seconds, or None")

    # ------------------------------------------------------------- LangChain glue
    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_cacheblend", "chat_models"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"store_key": "CACHEBLEND_STORE_KEY"}

    @property
    def _llm_type(self) -> str:
        return "cacheblend-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "store_path": self.store_path,
            **{name: getattr(self, name) for name in (*BLEND_FIELDS, *_GENERATION_OPTIONS)},
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

    def _resolve_model_profile(self) -> ModelProfile | None:
        # Run after the engine is loaded (CacheBlendSettings' validator comes first).
        return model_profile(self.get_engine())

    # ------------------------------------------------------------ token counts
    def get_token_ids(self, text: str) -> list[int]:
        """The model's own token ids of ``text`` (no special tokens added), offline; ``custom_get_token_ids``
        wins where set. LangChain's default would fetch GPT-2's tokenizer from the hub."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self.get_engine().tokenize(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[dict[str, Any] | type | Callable | BaseTool] | None = None) -> int:
        """Tokens of the prompt ``messages`` become: rendered with the chat template, as a call renders them
        (the template's own tokens and the assistant's opening included), and with ``tools`` described as a
        call with them bound describes them. What ``trim_messages(token_counter=llm)`` counts."""
        if not messages:
            return 0
        functions = tool_functions([convert_to_openai_tool(tool) for tool in tools or ()])
        prompt = render_prompt(self.get_engine().tokenizer, messages, self.chat_template_kwargs, functions)
        return len(self.get_token_ids(prompt))

    # ------------------------------------------------------------------ engine
    def get_engine(self) -> CacheBlendEngine:
        """The engine (shared with other chat models and LLMs naming the same model)."""
        assert self.engine is not None
        return self.engine

    @property
    def known_chunk_texts(self) -> list[str]:
        """Chunk texts this model looks for in its prompts, oldest first."""
        return self.service.announced.known()

    def announce_chunks(self, texts: Iterable[str | Document]) -> None:
        """Tell the model that coming prompts may contain these chunk texts verbatim."""
        self.service.announce(texts_of(texts))

    def forget_chunks(self) -> None:
        """Stop looking for any announced chunk text (cached KV stays in the chunk cache)."""
        self.service.announced.clear()

    def warm(self, items: Iterable[str | Document], *, show_progress: bool = True,
             for_request: bool = False) -> WarmSummary:
        """Precompute the KV of chunks not yet cached, and announce them all. ``for_request`` (the
        retriever's at query time): the coming call's stats count the chunks computed here as
        ``precomputed_for_request`` rather than as store hits."""
        texts = texts_of(items)
        summary = self.precompute_texts(texts, show_progress=show_progress, for_request=for_request)
        self.announce_chunks(texts)
        return summary

    def _announce_tool_results(self, messages: Sequence[BaseMessage]) -> None:
        """Agentic RAG: documents tool messages carry as their artifact (a retriever tool's with
        ``response_format="content_and_artifact"``) are chunks this call blends. The ones not announced yet
        (a retriever tool without CacheBlendRetriever, a replayed conversation) are warmed, the store's
        misses counted as ``precomputed_for_request``, and announced."""
        if not self.reuse_chunk_kv:
            return
        texts = self.service.announced.unannounced(d.page_content for d in tool_result_documents(messages))
        if texts:
            self.warm(texts, show_progress=False, for_request=True)

    # ---------------------------------------------------------------- settings
    def _blend_config(self, options: dict[str, Any]) -> BlendConfig:
        return self.blend_config_with({k: v for k, v in options.items() if k in BLEND_FIELDS})

    def _generation_config(self, options: dict[str, Any], stop: list[str] | None) -> GenerationConfig:
        return self.generation_config_with(options.get("max_tokens", self.max_tokens),
                                           stop if stop is not None else self.stop, options)

    def _call_settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> _CallSettings:
        # LangChain passes its own tracing keys (ls_*) and `stream` along with user options.
        options = {k: v for k, v in kwargs.items() if not k.startswith("ls_") and k != "stream"}
        unknown = sorted(set(options) - _CALL_OPTIONS)
        if unknown:
            raise unknown_names_error("ChatCacheBlend", unknown, set(_CALL_OPTIONS), "call option")
        model = options.get("model")
        if model is not None and model != self.model:
            raise ValueError(
                f"this ChatCacheBlend serves {self.model!r} and cannot switch to model={model!r} per call; "
                f"create ChatCacheBlend(model={model!r}) instead"
            )
        timeout = options.get("timeout", self.timeout)
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds, or None")
        tools, required = chosen_tools(tool_functions(options.get("tools") or []), options.get("tool_choice"))
        generation = constrained(self._generation_config(options, stop), tools, required, options.get("response_format"),
                                 tool_format(self.get_engine().tokenizer).arguments_key)
        parallel = options.get("parallel_tool_calls") is not False
        return _CallSettings(generation, self._blend_config(options), timeout, tools, required, parallel)

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
        started = time.perf_counter()
        tokenizer = self.get_engine().tokenizer
        self._announce_tool_results(messages)
        prompt = render_prompt(tokenizer, messages, self.chat_template_kwargs, settings.tools, settings.tool_required)
        stream = self.service.stream(prompt, settings.generation, settings.blend, reuse=self.reuse_chunk_kv)
        # A thinking model's thinking streams as reasoning_content; with tools bound, the answer after it is
        # held only while it may still be a call.
        calls = ToolCallStream.for_tokenizer(tokenizer, settings.tools, required=settings.tool_required,
                                             parallel=settings.parallel_tool_calls) if settings.tools else None
        answer = AnswerStream.for_prompt(tokenizer, prompt, calls)
        try:
            for delta in stream:
                if settings.timeout is not None and time.perf_counter() - started > settings.timeout:
                    raise TimeoutError(f"generation took longer than timeout={settings.timeout}s")
                shown = answer.feed(delta)
                if shown.reasoning or shown.answer:
                    yield text_chunk(shown)
            # The text has ended: what the answer held back (text that might have opened a call) goes out now,
            # before the request's bookkeeping that result() waits for (its K/V kept for the next call, ~0.1 s
            # for a 3,300-token prompt of Qwen2.5-Coder-1.5B on a 2-core CPU).
            rest, call = answer.finish()
            if rest.reasoning or rest.answer:
                yield text_chunk(rest)
            if call is not None:  # every call of the answer, in order (parallel calls)
                yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                    ToolCallChunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=i)
                    for i, c in enumerate(calls.calls)]))
            served = stream.result()
        finally:
            stream.close()
        result = served.result
        usage = UsageMetadata(
            input_tokens=result.prompt_tokens,
            output_tokens=result.completion_tokens,
            total_tokens=result.prompt_tokens + result.completion_tokens,
            input_token_details=InputTokenDetails(cache_read=result.stats.reused_tokens),
        )
        # The stats under one key, beside LangChain's own (finish_reason comes from generation_info).
        stats = {**self.stats_of(served), **(calls.stats() if calls is not None else {})}
        metadata = {"model_name": self.model, "model_provider": "cacheblend", "cacheblend": stats}
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
        # One code path for invoke and stream, so both give the same answer, reasoning and stats.
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

    def batch(
        self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None, *,
        return_exceptions: bool = False, **kwargs: Any,
    ) -> list[AIMessage]:
        """``invoke`` on every input at once. Runnable's default runs at most ``min(32, cores + 4)`` calls
        at a time (6 on two cores); the engine's scheduler decodes whatever is in flight as one batch, so
        unless ``max_concurrency`` says otherwise, up to twice its batch size are in flight."""
        configs = get_config_list(config, len(inputs))
        in_flight = min(len(inputs), 2 * self.service.scheduler.config.max_batch_size) or None
        configs = [c if c.get("max_concurrency") else {**c, "max_concurrency": in_flight} for c in configs]
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    # ------------------------------------------------------------------ tools
    def bind_tools(
        self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
        tool_choice: dict | str | bool | None = None, **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools: the model may answer with a call (``tool_choice`` "auto", the default), must call one
        ("any", "required" or a tool's name; decoding is then constrained to a valid call), or none ("none").
        Tools are listed in the model's own format where its chat template has one (Qwen2.5's ``<tool_call>``,
        Llama 3's JSON), else in a system turn of ours; an answer's several calls all land in ``tool_calls``
        unless ``parallel_tool_calls=False`` (the first is kept; ``dropped_tool_calls`` in the stats)."""
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        chosen_tools(tool_functions(formatted), tool_choice)  # a choice naming no bound tool fails here
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self, schema: dict | type | None = None, *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False, **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Answers parsed into ``schema`` (a pydantic class, a TypedDict or a JSON schema). Every method
        constrains decoding to valid JSON: ``function_calling`` (the default) as a call of a tool of that
        schema, ``json_schema`` as the schema itself, ``json_mode`` as the schema too when one is given
        (the parser needs it; an API model would only be asked for an object), else any JSON object."""
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema: a pydantic class, a TypedDict or a "
                                 "JSON schema (or use method='json_mode' for any JSON object)")
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        return json_structured_output(self, schema, method, include_raw, kwargs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop=stop, **kwargs))


__all__ = ["ChatCacheBlend"]
