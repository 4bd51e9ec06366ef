"""CacheBlendLLM: a LlamaIndex LLM that answers RAG prompts from precomputed chunk KV caches.

A query engine hands the LLM one flat prompt string. Beforehand, the
``CacheBlendNodePostprocessor`` (``llama-index-postprocessor-cacheblend``) has announced the
retrieved chunk texts and made sure their KV is in the chunk store. Every call is one chat turn
(:class:`cacheblend_rag.serving.ChatTurn`) answered by :meth:`run_turn`: in process, the messages are
rendered with the tokenizer's chat template, every announced chunk found verbatim is blended from its
cached KV with selective recompute, and the answer decodes on the engine's scheduler; with
``base_url``, a running ``cacheblend-rag serve`` does the same, the announced chunks in the messages
going to it as the request's documents. A prompt with no announced chunk in it is answered by plain
full prefill, and the stats say so. Each response carries the stats in ``additional_kwargs`` (and ``raw``).
"""

from __future__ import annotations

import warnings

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

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
    TextBlock,
    ThinkingBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from cacheblend_rag.serving import (
    BLEND_FIELDS, SAMPLING_FIELDS, BlendService, CacheBlendEngine, CacheBlendSettings, ChatTurn, ChunkCache,
    ConfigError, GenerationConfig, ReasoningDelta, TextDelta, TokenCounter, ToolCall, ToolCalls, TurnEnd, TurnEvent,
    chosen_tools, call_answer_length, iterate_in_thread, render_chat, tool_functions, tools_instruction, unknown_names_error,
)
from llama_index.llms.cacheblend._chat_turns import chat_dicts

_CALL_OPTIONS = frozenset({"max_new_tokens", "max_tokens", "stop", *SAMPLING_FIELDS, *BLEND_FIELDS, "tools",
                           "tool_choice", "tool_required", "allow_parallel_tool_calls", "response_format",
                           "generate_kwargs", "cache_salt", "timeout"})


class CacheBlendLLM(FunctionCallingLLM, CacheBlendSettings):
    """A model that reuses precomputed chunk KV caches (CacheBlend) for RAG prompts, loaded here or
    answering through a running ``cacheblend-rag serve``.

    >>> llm = CacheBlendLLM()                        # embedded SmolLM2-135M-Instruct, KV in memory
    >>> llm = CacheBlendLLM(base_url="http://127.0.0.1:8000", api_key="...")   # or: a server's model
    >>> query_engine = index.as_query_engine(
    ...     llm=llm, node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])

    With ``base_url`` nothing is loaded here: every call (``complete``, ``chat``, streaming, async, tools,
    structured output) is a request to the server, the postprocessor's nodes go to it as the request's
    documents and are warmed in its store, and responses carry the server's stats in the same places.
    ``api_key`` (else ``$CACHEBLEND_API_KEY``) is never in ``repr``, ``to_dict`` or ``to_json``; nor is the
    password of a ``store_path`` URL, which moves to ``store_password`` (else ``$CACHEBLEND_STORE_PASSWORD``):
    ``store_path`` then reads ``redis://:***@host/0``, and ``from_dict`` of a ``to_dict`` takes the variable.

    The model, store and blending fields are shared with LangChain's ``ChatCacheBlend``
    (:class:`cacheblend_rag.serving.CacheBlendSettings`). Set ``reuse_chunk_kv=False`` for the
    same model with plain full prefill (a baseline). ``cache_salt`` (also a keyword of each call) keeps a
    tenant's cached prompts and answers apart from other salts'; ``chunk_sharing="per_salt"`` its chunks too.
    Responses carry their own call's stats; counters over all calls are ``llm.service.stats()``.
    """

    # --- generation (with the sampling fields shared with LangChain; each call may override them)
    max_new_tokens: int = Field(default=256, description="Most tokens generated per answer.")
    stop: List[str] = Field(default_factory=list, description="Strings that end the answer.")
    timeout: Optional[float] = Field(
        default=None, description="Seconds one call may take, from its submission to its answer's end; a longer call "
        "raises TimeoutError (as ChatCacheBlend's timeout; each call may pass its own)."
    )

    # --- LlamaIndex behaviour
    context_window: Optional[int] = Field(
        default=None, description="Prompt + answer tokens; None takes the model's maximum position (the server's)."
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

    # Pickled without the model, attached again on first use (cacheblend_rag.serving.pickling); BaseComponent's
    # own would re-run __init__ on unpickling, loading the model at once.
    __setstate__ = CacheBlendSettings.__setstate__

    def __init__(self, **kwargs: Any) -> None:
        """``engine=`` and ``chunk_cache=`` let several LLMs share one loaded model and one store;
        ``base_url=`` (and ``api_key=``) answers through a server instead."""
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
        _ = self.generation_config  # a bad value fails here, before the model is loaded
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigError(f"timeout={self.timeout!r} must be a positive number of seconds, or None")

    @field_validator("context_window")
    @classmethod
    def _context_window_is_positive(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError(f"context_window={value} must be a positive number of tokens (prompt and answer), "
                             "or None for the model's own")
        return value

    def _open_service(self) -> BlendService:
        service = super()._open_service()
        # Known only once the engine is: LlamaIndex would build prompts the model cannot hold.
        own = self.engine.context_window
        if self.context_window is not None and self.context_window > own:
            raise ValueError(f"context_window={self.context_window} is above {self.engine.model_name}'s own "
                             f"context window of {own} tokens; pass at most {own}, or None to take the model's")
        return service

    @property
    def generation_config(self) -> GenerationConfig:
        return self.generation_config_with(self.max_new_tokens, self.stop, {})

    # ------------------------------------------------------------ properties
    @property
    def metadata(self) -> LLMMetadata:
        """The context window and name of the model, the server's with ``base_url`` (asked once)."""
        if self.is_remote:
            served = self.remote.context_window or DEFAULT_CONTEXT_WINDOW
            window, name = min(self.context_window or served, served), self.remote.model_info().get("id") or self.model
        else:
            window, name = self.context_window or self.engine.context_window, self.engine.model_name
        return LLMMetadata(context_window=window, num_output=self.max_new_tokens, is_chat_model=self._is_chat,
                           is_function_calling_model=True, model_name=name)

    @property
    def _is_chat(self) -> bool:
        if self.is_chat_model is not None:
            return self.is_chat_model
        # A server renders every request with its model's chat template.
        return self.is_remote or bool(getattr(self.engine.tokenizer, "chat_template", None))

    @property
    def tokenizer_fn(self) -> Callable[[str], List[int]]:
        """The model's own tokenizer, as LlamaIndex's token counters take one: ``Settings.tokenizer =
        llm.tokenizer_fn`` makes memory buffers, the prompt helper and ``TokenCountingHandler`` count the
        model's tokens (LlamaIndex's default is tiktoken's, another model's). Not with ``base_url``."""
        if self.is_remote:
            raise ConfigError(
                f"tokenizer_fn is the model's own tokenizer, and this CacheBlendLLM answers through the server at "
                f"{self.base_url}: no model or tokenizer is loaded here. Load the served model's tokenizer here "
                "(tokenizer_fn=transformers.AutoTokenizer.from_pretrained(<its folder or hub id>).encode), or keep "
                "LlamaIndex's default counter; each response's raw['usage'] has the server's own token counts")
        return TokenCounter(self.engine.tokenizer)  # not engine.tokenize: a handler keeping it would hold the model

    @property
    def last_prompt(self) -> Optional[str]:
        """The rendered prompt string of the most recent call (after chat templating). With ``base_url`` the
        server renders messages: then the prompt sent, for a completion, else None."""
        return self._last_prompt

    @property
    def last_stats(self) -> Optional[Dict[str, Any]]:
        """The stats of the most recent finished call (also in each response's ``additional_kwargs``)."""
        return self._last_stats

    # ------------------------------------------------------- chunk handling
    def announce_chunks(self, texts: Sequence[str]) -> List[str]:
        """Tell the LLM which chunk texts the coming prompts will contain (the postprocessor does this);
        with ``base_url``, those found in a call's messages go to the server as its documents."""
        return self.announced.announce(texts)

    def forget_chunks(self) -> None:
        """Drop every announced chunk text (the stored KV stays)."""
        self.announced.clear()

    def warm(self, items: Sequence[Any], *, announce: bool = True, show_progress: bool = False,
             for_request: bool = False) -> Any:
        """Compute and store the KV of each chunk that the store lacks (the server's, with ``base_url``), and
        announce them (``announce=False``: only store them, as ingestion does); returns the store's summary.
        ``items``: texts, or nodes and documents (their content as the LLM sees it). ``for_request`` (the
        postprocessor's): computed for the coming query, whose stats count those chunks as
        ``precomputed_for_request`` rather than as store hits. LangChain's ``ChatCacheBlend.warm`` is the same."""
        texts = [_chunk_text(item) for item in items]
        summary = self.precompute_texts(texts, show_progress=show_progress, for_request=for_request)
        if announce:
            self.announce_chunks(texts)
        return summary

    def precompute(self, texts: Sequence[str], *, show_progress: bool = False, for_request: bool = False) -> Any:
        """Deprecated: ``warm(texts, announce=False)``, the name both integrations share."""
        warnings.warn("CacheBlendLLM.precompute() is deprecated; call warm() (the name LangChain's ChatCacheBlend "
                      "shares), with announce=False for precompute()'s behaviour of storing without announcing",
                      DeprecationWarning, stacklevel=2)
        return self.warm(texts, announce=False, show_progress=show_progress, for_request=for_request)

    # ------------------------------------------------------------ turns
    def _chat_turn(self, messages: Sequence[ChatMessage], kwargs: Dict[str, Any]) -> ChatTurn:
        """The turn of ``messages``: as chat-template dicts, rendered by the model's template (here or in the
        server), or as the prompt a custom ``messages_to_prompt`` (or a tokenizer without a template) makes,
        the bound tools then listed in our system turn."""
        templated = self.is_remote or getattr(self.engine.tokenizer, "chat_template", None)
        if self._custom_messages_to_prompt or not templated:
            tools, required = chosen_tools(tool_functions(kwargs.get("tools") or []), _tool_choice(kwargs))
            return self._turn(kwargs, prompt=self.messages_to_prompt(self._with_tools(messages, tools, required)))
        return self._turn(kwargs, messages=chat_dicts(messages))

    def _completion_turn(self, prompt: str, formatted: bool, kwargs: Dict[str, Any]) -> ChatTurn:
        return self._turn(kwargs, prompt=self._format_completion(prompt, formatted))

    def _format_completion(self, prompt: str, formatted: bool) -> str:
        if formatted:
            return prompt
        if self._custom_completion_to_prompt or not (self._is_chat and self.chat_template_for_completions):
            return self.completion_to_prompt(prompt)
        question = [ChatMessage(role=MessageRole.USER, content=prompt)]
        if self._custom_messages_to_prompt:
            return self.messages_to_prompt(question)
        if self.is_remote:
            return prompt  # the server sends a prompt as one user turn of its chat template
        return render_chat(self.engine.tokenizer, chat_dicts(question), [], required=False,
                           template_kwargs=self.chat_template_kwargs)

    def _turn(self, kwargs: Dict[str, Any], **conversation: Any) -> ChatTurn:
        """One call's turn: the fields, overridden by its keyword arguments (generation and blend settings,
        tools, ``response_format``; anything else is an error that names the closest one)."""
        unknown = sorted(set(kwargs) - _CALL_OPTIONS)
        if unknown:
            raise unknown_names_error("CacheBlendLLM", unknown, set(_CALL_OPTIONS), "call option")
        max_new_tokens = call_answer_length("CacheBlendLLM", kwargs, self.max_new_tokens, ("max_new_tokens", "max_tokens"))
        stop = kwargs.get("stop") if kwargs.get("stop") is not None else self.stop
        tools = list(kwargs.get("tools") or [])
        tool_functions(tools)  # a tool of another form is refused here, in process or not
        return ChatTurn(generation=self.generation_config_with(max_new_tokens, stop, kwargs), tools=tools,
                        tool_choice=_tool_choice(kwargs), response_format=kwargs.get("response_format"),
                        parallel_tool_calls=kwargs.get("allow_parallel_tool_calls", True),
                        blend_options={k: kwargs[k] for k in BLEND_FIELDS if k in kwargs},
                        cache_salt=kwargs.get("cache_salt"), timeout=kwargs.get("timeout", self.timeout),
                        **conversation)  # cache_salt None: the object's (run_turn)

    # ------------------------------------------------------------------ tools
    def _prepare_chat_with_tools(
        self, tools: Sequence[Any], user_msg: Optional[Union[str, ChatMessage]] = None,
        chat_history: Optional[List[ChatMessage]] = None, verbose: bool = False,
        allow_parallel_tool_calls: bool = False, tool_required: bool = False, **kwargs: Any,
    ) -> Dict[str, Any]:
        """What :meth:`chat` gets for ``chat_with_tools``: the messages, the tools in OpenAI format and
        whether a call is required (then decoding is constrained to a valid call)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(user_msg if isinstance(user_msg, ChatMessage) else ChatMessage(role="user", content=user_msg))
        return {"messages": messages, "tools": [t.metadata.to_openai_tool(skip_length_check=True) for t in tools],
                "tool_required": tool_required, "allow_parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> List[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls", [])
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected a tool call, the model answered: {response.message.content!r}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in calls]

    @staticmethod
    def _with_tools(messages: Sequence[ChatMessage], tools: List[Dict[str, Any]], required: bool) -> List[ChatMessage]:
        """``messages`` after our system turn listing ``tools`` (for a prompt without the chat template)."""
        if not tools:
            return list(messages)
        return [ChatMessage(role=MessageRole.SYSTEM, content=tools_instruction(tools, required)), *messages]

    # ------------------------------------------------------------ answers
    def _stream(self, turn: ChatTurn, as_chat: bool) -> Iterator[Any]:
        """A response per delta of the turn's thinking or text (a thinking delta in ``additional_kwargs
        ["thinking_delta"]`` and the message's ``ThinkingBlock``, as llama-index-llms-ollama gives them; text
        only once it cannot be the start of a call). One delta is held back so that the last response carries
        the stats and, when the answer was a call, the call (as :meth:`chat` gives it)."""
        # A generator (not any iterator): LlamaIndex's callback decorator wraps only generators.
        answer, held, last = _Answer(), None, ("", "")
        events = self.run_turn(turn)
        try:
            for event in events:
                part = answer.add(event)
                if part is None:
                    continue
                if held is not None:
                    yield held
                held, last = self._response(as_chat, answer, *part), part
        finally:
            events.close()  # a consumer that stops early cancels the request
        yield self._response(as_chat, answer, *last, ended=turn)

    def _whole(self, turn: ChatTurn, as_chat: bool) -> Any:
        answer = _Answer()
        events = self.run_turn(turn)
        try:
            for event in events:
                answer.add(event)
        finally:
            events.close()
        return self._response(as_chat, answer, answer.reasoning, None, ended=turn)

    async def _awhole(self, turn: ChatTurn, as_chat: bool) -> Any:
        # The turn runs in a worker thread (the engine's scheduler, or the server's stream); a cancelled task
        # stops it at its next event, which cancels the request.
        answer = _Answer()
        async for event in iterate_in_thread(lambda: self.run_turn(turn)):
            answer.add(event)
        return self._response(as_chat, answer, answer.reasoning, None, ended=turn)

    def _response(self, as_chat: bool, answer: "_Answer", reasoning: str, delta: Optional[str],
                  ended: Optional[ChatTurn] = None) -> Any:
        """A response to the answer so far; ``ended``: the turn has ended, the response carries its stats."""
        extra, raw = self._finish(ended, answer.end) if ended is not None else ({}, None)
        extra = {**extra, **({"thinking_delta": reasoning} if reasoning else {})}
        if not as_chat:
            return CompletionResponse(text=answer.text, delta=delta, additional_kwargs=extra, raw=raw)
        message = _answer_message(answer.reasoning, answer.text, answer.calls if ended is not None else [])
        return ChatResponse(message=message, delta=delta, additional_kwargs=extra, raw=raw)

    def _finish(self, turn: ChatTurn, end: Optional[TurnEnd]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        if end is None:
            raise RuntimeError("the turn's events ended without its TurnEnd")
        prompt = end.prompt if end.prompt is not None else turn.prompt
        self._last_prompt, self._last_stats = prompt, end.stats
        # "usage" as LlamaIndex's TokenCountingHandler reads it: the tokens the model really saw.
        usage = {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
                 "total_tokens": end.prompt_tokens + end.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": end.cached_tokens}}
        # The stats flat (LlamaIndex's place for a response's extras) and under "cacheblend", the key LangChain's
        # response_metadata and a server's responses use, so code reading one integration reads the other.
        extra = {**end.stats, "cacheblend": end.stats}
        return extra, {"stats": end.stats, "prompt": prompt, "token_ids": list(end.token_ids), "usage": usage}

    # ------------------------------------------------------ LlamaIndex API
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._whole(self._completion_turn(prompt, formatted, kwargs), as_chat=False)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream(self._completion_turn(prompt, formatted, kwargs), as_chat=False)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._whole(self._chat_turn(messages, kwargs), as_chat=True)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream(self._chat_turn(messages, kwargs), as_chat=True)

    # Async: the turn runs in a worker thread, so the event loop stays free.
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._awhole(self._completion_turn(prompt, formatted, kwargs), as_chat=False)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        turn = self._completion_turn(prompt, formatted, kwargs)
        return iterate_in_thread(lambda: self._stream(turn, as_chat=False))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._awhole(self._chat_turn(messages, kwargs), as_chat=True)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        turn = self._chat_turn(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for response in iterate_in_thread(lambda: self._stream(turn, as_chat=True)):
                yield response

        return gen()


class _Answer:
    """An answer as its turn's events come: the thinking and text so far, the calls, the end."""

    def __init__(self) -> None:
        self.reasoning, self.text = "", ""
        self.calls: List[ToolCall] = []
        self.end: Optional[TurnEnd] = None

    def add(self, event: TurnEvent) -> Optional[Tuple[str, str]]:
        """Takes ``event`` in; a delta gives back (its thinking, its text), anything else None."""
        if isinstance(event, ReasoningDelta):
            self.reasoning += event.text
            return event.text, ""
        if isinstance(event, TextDelta):
            self.text += event.text
            return "", event.text
        if isinstance(event, ToolCalls):
            self.calls = list(event.calls)
        elif isinstance(event, TurnEnd):
            self.end = event
        return None


def _tool_choice(kwargs: Dict[str, Any]) -> Any:
    """A call's ``tool_choice``, or "required" for ``tool_required`` (``_prepare_chat_with_tools``' form)."""
    return kwargs.get("tool_choice") or ("required" if kwargs.get("tool_required") else None)


def _answer_message(reasoning: str, text: str, calls: Sequence[ToolCall]) -> ChatMessage:
    """The assistant's message: its thinking as a ``ThinkingBlock`` beside the text (what it wrote before any
    call), and ``calls`` in the form ``get_tool_calls_from_response`` reads."""
    blocks: List[Any] = [ThinkingBlock(content=reasoning)] if reasoning else []
    blocks.append(TextBlock(text=text))
    made = {"tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]} if calls else {}
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=made)


__all__ = ["CacheBlendLLM"]


def _chunk_text(item: Any) -> str:
    """A chunk's text: a string as is, a node or document as the LLM reads it (its metadata for the LLM)."""
    if isinstance(item, str):
        return item
    get_content = getattr(item, "get_content", None)
    if get_content is None:
        raise TypeError(f"warm() takes texts, nodes or documents, not {type(item).__name__}")
    from llama_index.core.schema import MetadataMode

    return get_content(metadata_mode=MetadataMode.LLM)
