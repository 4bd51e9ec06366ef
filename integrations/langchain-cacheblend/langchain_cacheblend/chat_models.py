"""ChatCacheBlend: a LangChain chat model that answers with CacheBlend.

How a call works: the messages become one chat turn (:class:`cacheblend_rag.serving.ChatTurn`: the
messages as chat-template dicts, the generation and blend settings, the bound tools, a response format,
the timeout) and the serving layer answers it (:meth:`~cacheblend_rag.serving.CacheBlendSettings.run_turn`),
yielding text, reasoning, tool calls and the turn's end, which become LangChain's chunks:

* in process (the default), the turn is rendered with the model's chat template, the chunk texts this
  model was told about (by :class:`~langchain_cacheblend.CacheBlendRetriever` or
  :meth:`ChatCacheBlend.warm`) are found verbatim, looked up in the chunk cache (computed on a miss) and
  blended with selective recompute, and the answer is decoded token by token. Where the tokenizer allows,
  the pieces keep the ids the whole prompt tokenizes to, so a blend at ratio 1.0 reproduces the plain
  model exactly. With no known chunk in the prompt this is plain full prefill, so the model also works
  as an ordinary local chat model;
* with ``base_url``, a running ``cacheblend-rag serve`` does the same, the announced chunk texts found in
  the messages going to it as the request's documents; nothing is loaded here.
"""

from __future__ import annotations

import json
import logging
from contextlib import closing
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

from cacheblend_rag.serving import (
    BLEND_FIELDS,
    SAMPLING_FIELDS,
    BlendConfig,
    BlendInputError,
    CacheBlendEngine,
    CacheBlendSettings,
    ChatTurn,
    ConfigError,
    ContextWindowError,
    GenerationConfig,
    ReasoningDelta,
    TextDelta,
    ToolCalls,
    TurnEnd,
    WarmSummary,
    call_answer_length,
    chosen_tools,
    iterate_in_thread,
    thinks,
    tool_functions,
    unknown_names_error,
)
from langchain_cacheblend._errors import overflow_error
from langchain_cacheblend._messages import render_prompt, text_chunk, texts_of, to_chat_dicts
from langchain_cacheblend._profile import model_profile
from langchain_cacheblend._structured import json_structured_output
from langchain_cacheblend._tool_results import tool_result_documents

logger = logging.getLogger(__name__)

_GENERATION_OPTIONS = ("max_tokens", *SAMPLING_FIELDS)
_CALL_OPTIONS = frozenset({*_GENERATION_OPTIONS, *BLEND_FIELDS, "timeout", "model", "tools", "tool_choice",
                           "parallel_tool_calls", "response_format", "generate_kwargs", "pipeline_kwargs",
                           "cache_salt"})
# Calls of one batch() in flight at once against a server (base_url): its scheduler batches them there.
_REMOTE_BATCH_CONCURRENCY = 8


class ChatCacheBlend(BaseChatModel, CacheBlendSettings):
    """Chat model that reuses precomputed KV caches of retrieved chunks (CacheBlend): in process, or
    through a running ``cacheblend-rag serve`` (``base_url``).

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
            in memory. Chat models on the same engine and store share one chunk cache. A URL's
            password moves to ``store_password`` (a secret, else ``$CACHEBLEND_STORE_PASSWORD``):
            ``store_path`` reads ``redis://:***@host/0`` in repr, dumps, traces and cache keys.
        device, dtype: where and in what precision to load the model.
        chat_template_kwargs: variables of the chat template (``{"enable_thinking": False}`` for Qwen3).

    Key init args (server):
        base_url: ``"http://host:port"`` of a running ``cacheblend-rag serve`` (with or without ``/v1``):
            the model answers there, nothing is loaded here, and everything below works the same
            (retrievers, tools, structured output, stats). ``model`` then names the served model
            (unset: whichever it serves).
        api_key: the server's key (else ``$CACHEBLEND_API_KEY``); a refused key raises ``PermissionError``.

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
            # or, against a server: ChatCacheBlend(base_url="http://127.0.0.1:8000", max_tokens=64)
            retriever = CacheBlendRetriever(retriever=vectorstore.as_retriever(), llm=llm)

    Invoke:
        .. code-block:: python

            msg = llm.invoke("What is the capital of France?")
            stats = msg.response_metadata["cacheblend"]
            stats["ttft_s"], stats["reused_tokens"]

    Key init args (tenants):
        cache_salt: the requests' cache salt (a tenant's name): different salts share no cached K/V
            of prompts or answers; chunk_sharing ("shared" or "per_salt") says whether they share chunks.

    Every call (also per call through ``bind``) accepts ``max_tokens``, the sampling options,
    ``timeout``, ``cache_salt`` and the blending options above.
    ``response_metadata["cacheblend"]`` carries this call's own blend stats (``ttft_s``, ``mode``, ``cached_tokens``,
    ``reused_tokens``, ``recomputed_tokens``, ``fresh_tokens``, ``cache_hits``,
    ``cache_misses``, ``timings``; ``total_tokens`` there counts prompt tokens) and
    ``usage_metadata`` counts tokens, with ``input_token_details["cache_read"]`` the prompt
    tokens whose K/V was reused from a cache rather than computed for this call.

    ``max_retries``, a standard parameter of hosted models, is accepted and ignored; any other unknown
    argument is an error.
    """

    # A standard parameter of hosted models: accepted, and it means nothing here (a call is not retried).
    _ignored_init_args: ClassVar[frozenset[str]] = frozenset({"max_retries"})

    _max_tokens_field: ClassVar[str] = "max_tokens"

    max_tokens: int = 256
    stop: list[str] | None = None
    timeout: float | None = None
    """Seconds one call may take, from its submission to its answer's end; a longer call raises ``TimeoutError``."""
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
        # dumps writes a placeholder for each; loads(secrets_map=...) fills it, else the field's variable does.
        return {"store_key": "CACHEBLEND_STORE_KEY", "api_key": "CACHEBLEND_API_KEY",
                "store_password": "CACHEBLEND_STORE_PASSWORD"}

    @property
    def _llm_type(self) -> str:
        return "cacheblend-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            **({"base_url": self.base_url} if self.is_remote else {}),
            "store_path": self.store_path,
            **{name: getattr(self, name) for name in (*BLEND_FIELDS, *_GENERATION_OPTIONS)},
            "stop": self.stop,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        model = kwargs.get("model")
        if not isinstance(model, str):
            try:
                model = self.served_model
            except Exception:  # noqa: BLE001 (tracing never fails a call: the call itself says what is wrong)
                model = self.model
        params = LangSmithParams(
            ls_provider="cacheblend",
            ls_model_name=model,
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

    @property
    def served_model(self) -> str:
        """The name of the model that answers: ``model``, or, against a server given no ``model``, the one
        it serves (``/v1/models``, asked once)."""
        if not self.is_remote or self.remote.model is not None:
            return self.model
        return str(self.remote.model_info().get("id") or self.model)

    def _resolve_model_profile(self) -> ModelProfile | None:
        # Run after the engine is loaded (CacheBlendSettings' validator comes first). A server says its window;
        # whether its model thinks is not known here.
        if self.is_remote:
            return model_profile(self.served_model, self.remote.context_window, None)
        engine = self.get_engine()
        return model_profile(engine.model_name, engine.context_window, thinks(engine.tokenizer))

    # ------------------------------------------------------------ token counts
    def get_token_ids(self, text: str) -> list[int]:
        """The model's own token ids of ``text`` (no special tokens added), offline; ``custom_get_token_ids``
        wins where set. LangChain's default would fetch GPT-2's tokenizer from the hub."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self._local_engine("count tokens").tokenize(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[dict[str, Any] | type | Callable | BaseTool] | None = None) -> int:
        """Tokens of the prompt ``messages`` become: rendered with the chat template, as a call renders them
        (the template's own tokens and the assistant's opening included), and with ``tools`` described as a
        call with them bound describes them. What ``trim_messages(token_counter=llm)`` counts. Against a
        server (no chat template here) only with ``custom_get_token_ids``, message by message as LangChain
        counts them."""
        if not messages:
            return 0
        if self.is_remote and self.custom_get_token_ids is not None:
            return super().get_num_tokens_from_messages(messages, tools)
        engine = self._local_engine("count tokens")
        functions = tool_functions([convert_to_openai_tool(tool) for tool in tools or ()])
        prompt = render_prompt(engine.tokenizer, messages, self.chat_template_kwargs, functions)
        return len(self.get_token_ids(prompt))

    # ------------------------------------------------------------------ engine
    def get_engine(self) -> CacheBlendEngine:
        """The engine (shared with other chat models and LLMs naming the same model); in process only."""
        if self.is_remote:
            raise ConfigError(f"this ChatCacheBlend answers through the server at {self.base_url}: there is no "
                              "engine in this process (the model is the server's); drop base_url to load it here")
        assert self.engine is not None
        return self.engine

    def _local_engine(self, what: str) -> CacheBlendEngine:
        if self.is_remote:
            raise NotImplementedError(
                f"ChatCacheBlend(base_url={self.base_url!r}) cannot {what}: the model and its tokenizer are the "
                "server's, none is loaded here. Pass custom_get_token_ids= (the model's tokenizer's encode, e.g. "
                "transformers.AutoTokenizer.from_pretrained(...).encode), read a call's usage_metadata"
                "['input_tokens'], or drop base_url to load the model in process")
        return self.get_engine()

    @property
    def known_chunk_texts(self) -> list[str]:
        """Chunk texts this model looks for in its prompts, oldest first."""
        return self.announced.known()

    def announce_chunks(self, texts: Iterable[str | Document]) -> None:
        """Tell the model that coming prompts may contain these chunk texts verbatim (against a server:
        those found in a call's messages go as its documents)."""
        self.announced.announce(texts_of(texts))

    def forget_chunks(self) -> None:
        """Stop looking for any announced chunk text (cached KV stays in the chunk cache)."""
        self.announced.clear()

    def warm(self, items: Iterable[str | Document], *, announce: bool = True, show_progress: bool = True,
             for_request: bool = False) -> WarmSummary:
        """Precompute the KV of chunks not yet cached (against a server: in its store), and announce them all
        (``announce=False``: only store them). ``for_request`` (the retriever's at query time): the coming call's
        stats count the chunks computed here as ``precomputed_for_request`` rather than as store hits (in
        process). LlamaIndex's ``CacheBlendLLM.warm`` is the same."""
        texts = texts_of(items)
        summary = self.precompute_texts(texts, show_progress=show_progress, for_request=for_request)
        if announce:
            self.announce_chunks(texts)
        return summary

    def _announce_tool_results(self, messages: Sequence[BaseMessage]) -> None:
        """Agentic RAG: documents tool messages carry as their artifact (a retriever tool's with
        ``response_format="content_and_artifact"``) are chunks this call blends. The ones not announced yet
        (a retriever tool without CacheBlendRetriever, a replayed conversation) are announced: in process
        warmed first, the store's misses counted as ``precomputed_for_request``; against a server they go
        as the request's documents, which it finds in the tool messages (and computes on a miss)."""
        if not self.reuse_chunk_kv:
            return
        texts = self.announced.unannounced(d.page_content for d in tool_result_documents(messages))
        if texts and self.is_remote:
            self.announce_chunks(texts)
        elif texts:
            self.warm(texts, show_progress=False, for_request=True)

    # ---------------------------------------------------------------- settings
    def _blend_config(self, options: dict[str, Any]) -> BlendConfig:
        return self.blend_config_with({k: v for k, v in options.items() if k in BLEND_FIELDS})

    def _generation_config(self, options: dict[str, Any], stop: list[str] | None) -> GenerationConfig:
        length = call_answer_length("ChatCacheBlend", options, self.max_tokens, ("max_tokens",))
        return self.generation_config_with(length, stop if stop is not None else self.stop, options)

    def _call_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A call's options, checked: LangChain passes its own tracing keys (ls_*) and `stream` along."""
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
        return options

    def _turn(self, messages: Sequence[BaseMessage], stop: list[str] | None, options: dict[str, Any]) -> ChatTurn:
        """The chat turn of one call: what the serving layer answers, in process or on the server."""
        if not messages:
            raise BlendInputError("no messages to answer; pass at least one message")
        return ChatTurn(
            generation=self._generation_config(options, stop),
            messages=to_chat_dicts(messages),
            tools=list(options.get("tools") or ()),
            tool_choice=options.get("tool_choice"),
            parallel_tool_calls=options.get("parallel_tool_calls") is not False,
            response_format=options.get("response_format"),
            timeout=options.get("timeout", self.timeout),
            blend_options={k: v for k, v in options.items() if k in BLEND_FIELDS},
            template_kwargs=self.chat_template_kwargs,
            cache_salt=options.get("cache_salt"),  # None: the object's (run_turn)
        )

    # -------------------------------------------------------------- generation
    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # Token callbacks are fired by BaseChatModel for every chunk yielded here.
        options = self._call_options(kwargs)
        self._announce_tool_results(messages)
        turn = self._turn(messages, stop, options)
        # Text streams as it can be shown (held only while it may still open a tool call), a thinking model's
        # thinking as reasoning_content; the calls come whole once the text has ended, before the request's
        # bookkeeping; the turn's end carries the counts and stats. Leaving early cancels the request.
        try:
            yield from self._events(turn)
        except ContextWindowError as exc:  # before any text: the window is checked before the prompt runs
            raise overflow_error(exc) from exc

    def _events(self, turn: ChatTurn) -> Iterator[ChatGenerationChunk]:
        with closing(self.run_turn(turn)) as events:
            for event in events:
                if isinstance(event, TextDelta):
                    yield text_chunk(event.text)
                elif isinstance(event, ReasoningDelta):
                    yield text_chunk(reasoning=event.text)
                elif isinstance(event, ToolCalls):  # every call of the answer, in order (parallel calls)
                    yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                        ToolCallChunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=i)
                        for i, c in enumerate(event.calls)]))
                elif isinstance(event, TurnEnd):
                    yield self._last_chunk(event)

    def _last_chunk(self, end: TurnEnd) -> ChatGenerationChunk:
        usage = UsageMetadata(
            input_tokens=end.prompt_tokens,
            output_tokens=end.completion_tokens,
            total_tokens=end.prompt_tokens + end.completion_tokens,
            input_token_details=InputTokenDetails(cache_read=end.cached_tokens),
        )
        # The stats under one key, beside LangChain's own (finish_reason comes from generation_info).
        metadata = {"model_name": self.served_model, "model_provider": "cacheblend", "cacheblend": end.stats}
        return ChatGenerationChunk(
            message=AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last"),
            generation_info={"finish_reason": end.finish_reason},
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
        # The engine (or the server's client) works on a worker thread so the event loop stays free. Leaving
        # early stops the decode at its next token.
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop=stop, **kwargs)):
            yield chunk

    def batch(
        self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None, *,
        return_exceptions: bool = False, **kwargs: Any,
    ) -> list[AIMessage]:
        """``invoke`` on every input at once. Runnable's default runs at most ``min(32, cores + 4)`` calls
        at a time (6 on two cores); the engine's scheduler decodes whatever is in flight as one batch, so
        unless ``max_concurrency`` says otherwise, up to twice its batch size are in flight (against a
        server, 8: its scheduler batches them there)."""
        configs = get_config_list(config, len(inputs))
        most = _REMOTE_BATCH_CONCURRENCY if self.is_remote else 2 * self.service.scheduler.config.max_batch_size
        in_flight = min(len(inputs), most) or None
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
