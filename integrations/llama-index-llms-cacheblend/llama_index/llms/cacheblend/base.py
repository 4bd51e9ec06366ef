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

import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

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
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from cacheblend_rag.concurrency import iterate_in_thread, run_in_thread
from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.serving import BLEND_FIELDS, SAMPLING_FIELDS, CacheBlendSettings, Served, unknown_names_error
from cacheblend_rag.serving.service import BlendService
from cacheblend_rag.serving.answer_stream import AnswerStream
from cacheblend_rag.serving.tool_stream import ToolCallStream
from cacheblend_rag.serving.thinking import Thought
from cacheblend_rag.serving.tool_chat import render_chat
from cacheblend_rag.serving.tool_formats import tool_format
from cacheblend_rag.serving.tools import ToolCall, chosen_tools, constrained, tool_functions, tools_instruction
from cacheblend_rag.store import ChunkCache
from llama_index.llms.cacheblend._chat_turns import chat_dicts

logger = logging.getLogger(__name__)

_CALL_OPTIONS = frozenset({"max_new_tokens", "max_tokens", "stop", *SAMPLING_FIELDS, *BLEND_FIELDS, "tools",
                           "tool_choice", "tool_required", "allow_parallel_tool_calls", "response_format",
                           "generate_kwargs"})


class CacheBlendLLM(FunctionCallingLLM, CacheBlendSettings):
    """A local model that reuses precomputed chunk KV caches (CacheBlend) for RAG prompts.

    >>> llm = CacheBlendLLM()                        # embedded SmolLM2-135M-Instruct, KV in memory
    >>> query_engine = index.as_query_engine(
    ...     llm=llm, node_postprocessors=[CacheBlendNodePostprocessor(llm=llm)])

    The model, store and blending fields are shared with LangChain's ``ChatCacheBlend``
    (:class:`cacheblend_rag.serving.CacheBlendSettings`). Set ``reuse_chunk_kv=False`` for the
    same model with plain full prefill (a baseline).
    """

    # --- generation (with the sampling fields shared with LangChain; each call may override them)
    max_new_tokens: int = Field(default=256, description="Most tokens generated per answer.")
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

    # Pickled without the model, attached again on first use (cacheblend_rag.serving.pickling); BaseComponent's
    # own would re-run __init__ on unpickling, loading the model at once.
    __setstate__ = CacheBlendSettings.__setstate__

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
        return LLMMetadata(
            context_window=self.context_window or self.engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._is_chat,
            is_function_calling_model=True,
            model_name=self.engine.model_name,
        )

    @property
    def _is_chat(self) -> bool:
        if self.is_chat_model is not None:
            return self.is_chat_model
        return bool(getattr(self.engine.tokenizer, "chat_template", None))

    @property
    def tokenizer_fn(self) -> Callable[[str], List[int]]:
        """The model's own tokenizer, as LlamaIndex's token counters take one: ``Settings.tokenizer =
        llm.tokenizer_fn`` makes memory buffers, the prompt helper and ``TokenCountingHandler`` count the
        model's tokens (LlamaIndex's default is tiktoken's, another model's)."""
        return self.engine.tokenize

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

    def precompute(self, texts: Sequence[str], *, show_progress: bool = False, for_request: bool = False) -> Any:
        """Compute and store the KV of each chunk text that the store lacks; returns the store's summary.
        ``for_request`` (the postprocessor's): computed for the coming query, whose stats count those
        chunks as ``precomputed_for_request`` rather than as store hits."""
        return self.precompute_texts(list(texts), show_progress=show_progress, for_request=for_request)

    # ------------------------------------------------------------ prompting
    def _render_messages(self, messages: Sequence[ChatMessage], kwargs: Optional[Dict[str, Any]] = None) -> str:
        """The prompt of ``messages``, with the tools ``kwargs`` bind listed in the model's own format where
        its chat template has one, else in our system turn (:func:`cacheblend_rag.serving.tool_chat.render_chat`)."""
        tokenizer = self.engine.tokenizer
        tools, required = self._tools(kwargs or {})
        if self._custom_messages_to_prompt or not getattr(tokenizer, "chat_template", None):
            return self.messages_to_prompt(self._with_tools(messages, tools, required))
        return render_chat(tokenizer, chat_dicts(messages), tools, required=required,
                           template_kwargs=self.chat_template_kwargs)

    def _format_completion(self, prompt: str, formatted: bool) -> str:
        if formatted:
            return prompt
        if self._custom_completion_to_prompt or not (self._is_chat and self.chat_template_for_completions):
            return self.completion_to_prompt(prompt)
        return self._render_messages([ChatMessage(role=MessageRole.USER, content=prompt)])

    def _call_configs(self, kwargs: Dict[str, Any]) -> tuple:
        """The generation and blend configs of one call: the fields, overridden by its keyword arguments
        (generation and blend settings; anything else is an error that names the closest one)."""
        unknown = sorted(set(kwargs) - _CALL_OPTIONS)
        if unknown:
            raise unknown_names_error("CacheBlendLLM", unknown, set(_CALL_OPTIONS), "call option")
        max_new_tokens = kwargs.get("max_new_tokens") or kwargs.get("max_tokens") or self.max_new_tokens
        stop = kwargs.get("stop") if kwargs.get("stop") is not None else self.stop
        generation = self.generation_config_with(max_new_tokens, stop, kwargs)
        tools, required = self._tools(kwargs)
        generation = constrained(generation, tools, required, kwargs.get("response_format"),
                                 tool_format(self.engine.tokenizer).arguments_key)
        blend = self.blend_config_with({k: kwargs[k] for k in BLEND_FIELDS if k in kwargs})
        return generation, blend

    @staticmethod
    def _tools(kwargs: Dict[str, Any]) -> tuple:
        """The tools a call may use (OpenAI format, as ``_prepare_chat_with_tools`` passes them) and
        whether it must use one."""
        choice = kwargs.get("tool_choice") or ("required" if kwargs.get("tool_required") else None)
        return chosen_tools(tool_functions(kwargs.get("tools") or []), choice)

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

    def _answer(self, prompt: str, kwargs: Dict[str, Any]) -> tuple[AnswerStream, Optional[ToolCallStream]]:
        """How an answer to ``prompt`` is shown: a thinking model's thinking apart, and with tools bound,
        the answer after it held while it may still be a call (the second item: that call stream, or None).
        ``allow_parallel_tool_calls=False`` keeps the first of several calls."""
        tools, required = self._tools(kwargs)
        calls = ToolCallStream.for_tokenizer(self.engine.tokenizer, tools, required=required,
                                             parallel=kwargs.get("allow_parallel_tool_calls", True)) if tools else None
        return AnswerStream.for_prompt(self.engine.tokenizer, prompt, calls), calls

    def _answered(self, prompt: str, response: ChatResponse, kwargs: Dict[str, Any]) -> ChatResponse:
        """``response`` with its text read as a thinking model's thinking (a ``ThinkingBlock``, so
        ``message.content`` is the answer alone and a later turn's prompt leaves the thinking out) and, with
        tools bound, the answer after it as calls of bound tools, when it makes any."""
        answer, calls = self._answer(prompt, kwargs)
        thought, _ = answer.read(response.message.content or "")
        message = _answer_message(thought.reasoning, thought.answer, calls.calls if calls else [])
        stats = {**response.additional_kwargs, **(calls.stats() if calls else {})}
        return response.model_copy(update={"message": message, "additional_kwargs": stats})

    def _stream_chat(self, prompt: str, kwargs: Dict[str, Any]) -> ChatResponseGen:
        """Text streams as soon as it cannot be the start of a call; a thinking model's thinking streams as
        ``additional_kwargs["thinking_delta"]`` and the message's ``ThinkingBlock`` (as llama-index-llms-ollama
        gives them). The last response carries the stats and, when the answer was a call, the call (as
        :meth:`chat` gives it)."""
        # A generator (not any iterator): LlamaIndex's callback decorator wraps only generators.
        answer, calls = self._answer(prompt, kwargs)
        reasoning, shown, previous = "", "", None
        for response in self._generate_stream(prompt, kwargs):  # its last response carries the stats
            if previous is not None:
                part = answer.feed(previous.delta or "")
                if part.reasoning or part.answer:
                    reasoning, shown = reasoning + part.reasoning, shown + part.answer
                    yield ChatResponse(message=_answer_message(reasoning, shown, []), delta=part.answer,
                                       additional_kwargs=_thinking_delta(part.reasoning))
            previous = response
        assert previous is not None  # _generate_stream always ends with the response carrying the stats
        part = answer.feed(previous.delta or "")
        rest, _ = answer.finish()
        part = Thought(part.reasoning + rest.reasoning, part.answer + rest.answer)
        reasoning, shown = reasoning + part.reasoning, shown + part.answer
        stats = {**previous.additional_kwargs, **(calls.stats() if calls else {})}
        yield ChatResponse(message=_answer_message(reasoning, shown, calls.calls if calls else []), delta=part.answer,
                           additional_kwargs={**stats, **_thinking_delta(part.reasoning)},
                           raw=previous.raw)

    # ------------------------------------------------------------ generation
    def _generate(self, prompt: str, kwargs: Dict[str, Any]) -> CompletionResponse:
        generation, blend = self._call_configs(kwargs)
        served = self.service.generate(prompt, generation, blend, reuse=self.reuse_chunk_kv)
        return self._finish(prompt, served, text=served.result.text, delta=None)

    async def _agenerate(self, prompt: str, kwargs: Dict[str, Any]) -> CompletionResponse:
        generation, blend = self._call_configs(kwargs)
        stream = self.service.stream(prompt, generation, blend, reuse=self.reuse_chunk_kv)
        try:
            served = await run_in_thread(stream.result)
        finally:
            stream.close()  # a cancelled task's request leaves the scheduler at its next step
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
        stats = self.stats_of(served)
        self._last_prompt, self._last_stats = prompt, stats
        result = served.result
        # "usage" as LlamaIndex's TokenCountingHandler reads it: the tokens the model really saw.
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                 "total_tokens": result.prompt_tokens + result.completion_tokens}
        raw = {"stats": stats, "prompt": prompt, "token_ids": list(result.token_ids), "usage": usage}
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
        prompt = self._render_messages(messages, kwargs)
        return self._answered(prompt, _as_chat(self._generate(prompt, kwargs)), kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt = self._render_messages(messages, kwargs)
        return self._stream_chat(prompt, kwargs)

    # Async: the engine runs on the scheduler's worker thread, so the event loop stays free.
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._agenerate(self._format_completion(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        prompt = self._format_completion(prompt, formatted)
        return iterate_in_thread(lambda: self._generate_stream(prompt, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt = self._render_messages(messages, kwargs)
        response = await self._agenerate(prompt, kwargs)
        return self._answered(prompt, _as_chat(response), kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt = self._render_messages(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for response in iterate_in_thread(lambda: self._stream_chat(prompt, kwargs)):
                yield response

        return gen()


def _answer_message(reasoning: str, text: str, calls: Sequence[ToolCall]) -> ChatMessage:
    """The assistant's message: its thinking as a ``ThinkingBlock`` beside the text (what it wrote before any
    call), and ``calls`` in the form ``get_tool_calls_from_response`` reads."""
    blocks: List[Any] = [ThinkingBlock(content=reasoning)] if reasoning else []
    blocks.append(TextBlock(text=text))
    made = {"tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]} if calls else {}
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=made)


def _thinking_delta(reasoning: str) -> Dict[str, Any]:
    """A response's ``additional_kwargs`` entry for its thinking delta, where FunctionAgent's ``AgentStream``
    and llama-index-llms-ollama put it."""
    return {"thinking_delta": reasoning} if reasoning else {}


def _as_chat(response: CompletionResponse) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
        delta=response.delta,
        additional_kwargs=response.additional_kwargs,
        raw=response.raw,
    )


__all__ = ["CacheBlendLLM"]
