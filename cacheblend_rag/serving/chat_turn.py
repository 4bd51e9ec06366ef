"""One chat turn, from a conversation to events: what the HTTP server and both integrations stand on.

A :class:`ChatTurn` is everything one answer depends on: the conversation (chat-template dicts, or a
prompt already rendered), the request's documents, the tools and whether one must be called, a response
format, a timeout, a cache salt, and the generation and blend settings. :func:`run_turn` renders it with
the model's chat template, blends the documents' cached K/V (computed and stored on a miss), decodes on
the engine's scheduler and yields :data:`TurnEvent` s as the answer streams:

* :class:`TextDelta`: answer text that can be shown now (held while it may still open a tool call);
* :class:`ReasoningDelta`: a thinking model's thinking;
* :class:`ToolCalls`: the calls the answer made, once it ended (never for an ordinary answer);
* :class:`TurnEnd`: last, the finish reason, token counts and the stats a response reports.

The remote client (:mod:`~cacheblend_rag.serving.remote`) yields the same events from a server, so an
integration reads a turn the same way in process and over HTTP.

**Documents.** Each is one chunk. A document whose text appears verbatim in a message is found there (a
client that pastes its context into the user message still gets reuse); the others are rendered by the
chat template where it takes ``documents`` (Command R's, Granite's), else in one fixed place: at the start
of the last user message, each as ``title`` (if any) on its own line then the text, separated by a blank
line, and a blank line before the message's own text (:func:`render_documents`). A turn with documents
looks for those texts only; a turn without them, for the texts announced to the service (the in-process
retrievers').

**Cache salt.** Requests with different ``cache_salt`` share no cached K/V of their prompts or answers:
their prefix-cache blocks are chained from the salt and their segment-cache spans kept under it. Chunks
are shared across salts unless the service's ``chunk_sharing`` is ``"per_salt"`` (then keyed under the
salt too). ``None`` or ``""``: the shared namespace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Sequence, Union

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.errors import BlendInputError, ConfigError
from cacheblend_rag.reuse.prompt import chunk_text
from cacheblend_rag.serving.answer_stream import AnswerStream
from cacheblend_rag.serving.tool_chat import render_chat
from cacheblend_rag.serving.tool_formats import template_text, tool_format
from cacheblend_rag.serving.tool_stream import ToolCallStream
from cacheblend_rag.serving.tools import ToolCall, chosen_tools, constrained, tool_functions


@dataclass(frozen=True)
class Document:
    """One retrieved chunk a request brings (vLLM's ``documents`` entries): its text, and a title."""

    text: str
    title: str | None = None

    @classmethod
    def of(cls, value: Union["Document", Mapping[str, Any], str], index: int = 0) -> "Document":
        if isinstance(value, Document):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping) and isinstance(value.get("text"), str):
            title = value.get("title")
            if title is not None and not isinstance(title, str):
                raise BlendInputError(f"documents[{index}].title must be a string or absent, got {type(title).__name__}")
            return cls(value["text"], title)
        raise BlendInputError(f"documents[{index}] must be {{'text': str, 'title': str (optional)}} or a string, "
                              f"got {value!r:.80}")


@dataclass
class ChatTurn:
    """What one answer depends on. Give ``messages`` (chat-template dicts: ``role``, ``content``, an
    assistant's ``tool_calls``, a tool's ``tool_call_id``) or ``prompt`` (already rendered)."""

    generation: GenerationConfig
    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: str | None = None
    documents: Sequence[Union[Document, Mapping[str, Any], str]] = ()
    tools: Sequence[Mapping[str, Any]] = ()  # OpenAI format, as both frameworks make them
    tool_choice: Any = None  # None/"auto", "none", "required"/"any", a tool's name or OpenAI's dict
    parallel_tool_calls: bool = True  # False keeps the first of several calls
    response_format: Any = None  # {"type": "json_object"}, OpenAI's json_schema form, or a JSON schema
    timeout: float | None = None  # seconds from submission to the answer's end; then TimeoutError
    cache_salt: str | None = None
    blend_options: Mapping[str, Any] = field(default_factory=dict)  # BlendConfig fields for this turn
    reuse: bool | None = None  # None: the settings' reuse_chunk_kv
    template_kwargs: Mapping[str, Any] | None = None  # None: the settings' chat_template_kwargs
    # Without documents, look for the chunk texts announced to the service (the in-process retrievers'); a
    # server's requests bring their own or none (False), and other requests' announcements are not theirs.
    look_for_announced: bool = True

    def document_list(self) -> list[Document]:
        return [Document.of(d, i) for i, d in enumerate(self.documents)]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCalls:
    calls: list[ToolCall]


@dataclass(frozen=True)
class TurnEnd:
    """The turn's end: why it ended, its tokens (``cached_tokens``: prompt tokens whose K/V was reused,
    not computed), the stats a response reports, and (in process) the rendered prompt and token ids."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stats: dict[str, Any]
    prompt: str | None = None
    token_ids: tuple[int, ...] = ()
    served: Any = None  # the in-process Served (None from a server)


TurnEvent = Union[TextDelta, ReasoningDelta, ToolCalls, TurnEnd]


def template_takes_documents(tokenizer: Any) -> bool:
    """Whether the chat template renders a ``documents`` variable itself (Command R's, Granite's)."""
    return "documents" in template_text(tokenizer)


def render_documents(documents: Sequence[Document]) -> str:
    """The fixed rendering of documents for a template that does not take them (see the module)."""
    return "\n\n".join(f"{d.title}\n{d.text}" if d.title else d.text for d in documents)


def _with_documents(chat: list[dict[str, Any]], documents: Sequence[Document]) -> list[dict[str, Any]]:
    """``chat`` with ``documents`` opening its last user message (a user message of their own if none)."""
    block = render_documents(documents)
    for index in range(len(chat) - 1, -1, -1):
        if chat[index].get("role") == "user":
            content = chat[index].get("content") or ""
            chat[index] = {**chat[index], "content": f"{block}\n\n{content}" if content else block}
            return chat
    return [*chat, {"role": "user", "content": block}]


def appears_in(text: str, turn: ChatTurn) -> bool:
    """Whether ``text`` stands verbatim in one of ``turn``'s messages (or in its rendered prompt)."""
    contents = [m.get("content") for m in turn.messages or ()] + [turn.prompt]
    return any(isinstance(content, str) and text in content for content in contents)


def render_turn(tokenizer: Any, turn: ChatTurn, functions: list[dict[str, Any]], required: bool,
                template_kwargs: Mapping[str, Any]) -> str:
    """The prompt of ``turn``: its messages with the documents not found in them rendered (see the module)."""
    if turn.prompt is not None:
        if turn.messages:
            raise BlendInputError("a turn takes messages or a rendered prompt, not both")
        return turn.prompt
    if not turn.messages:
        raise BlendInputError("no messages to answer; pass at least one message")
    chat = [dict(m) for m in turn.messages]
    missing = [d for d in turn.document_list() if not appears_in(d.text, turn)]
    kwargs = dict(template_kwargs)
    if missing and template_takes_documents(tokenizer):
        kwargs["documents"] = [{"title": d.title or "", "text": d.text} for d in missing]
    elif missing:
        chat = _with_documents(chat, missing)
    return render_chat(tokenizer, chat, functions, required=required, template_kwargs=kwargs)


def run_turn(settings: Any, turn: ChatTurn) -> Iterator[TurnEvent]:
    """Answer ``turn`` on ``settings``' engine (a :class:`~cacheblend_rag.serving.CacheBlendSettings`),
    yielding its events. Closing the generator early cancels the request. Raises ``TimeoutError`` once
    ``turn.timeout`` seconds have passed since the call, whether the request waited, prefilled or decoded."""
    started = time.perf_counter()
    if turn.timeout is not None and not turn.timeout > 0:
        raise ConfigError(f"timeout={turn.timeout!r} must be a positive number of seconds, or None")
    service = settings.service
    tokenizer = service.engine.tokenizer
    functions, required = chosen_tools(tool_functions(list(turn.tools)), turn.tool_choice)
    generation = constrained(answers_tool_results(turn), functions, required,
                             turn.response_format, tool_format(tokenizer).arguments_key)
    blend = settings.blend_config_with(dict(turn.blend_options))
    reuse = settings.reuse_chunk_kv if turn.reuse is None else turn.reuse
    template_kwargs = settings.chat_template_kwargs if turn.template_kwargs is None else turn.template_kwargs
    prompt = render_turn(tokenizer, turn, functions, required, template_kwargs)
    documents = [t for t in (chunk_text(d.text) for d in turn.document_list()) if t]
    documents = documents or (None if turn.look_for_announced else [])
    titles = [d.title for d in turn.document_list() if d.title]  # a document's, so tokenized as one
    stream = service.stream(prompt, generation, blend, reuse=reuse, chunks=documents, salt=turn.cache_salt or "",
                            document_texts=titles)
    if turn.timeout is not None:
        stream.deadline = started + turn.timeout
    calls = ToolCallStream.for_tokenizer(tokenizer, functions, required=required,
                                         parallel=turn.parallel_tool_calls) if functions else None
    answer = AnswerStream.for_prompt(tokenizer, prompt, calls)
    try:
        for delta in stream:
            shown = answer.feed(delta)
            yield from _deltas(shown.reasoning, shown.answer)
        # The text has ended: what the answer held back goes out before the request's bookkeeping.
        rest, call = answer.finish()
        yield from _deltas(rest.reasoning, rest.answer)
        if call is not None:
            yield ToolCalls(list(calls.calls))
        served = stream.result()
    finally:
        stream.close()
    result = served.result
    stats = {**settings.stats_of(served), **(calls.stats() if calls is not None else {})}
    yield TurnEnd(result.finish_reason, result.prompt_tokens, result.completion_tokens, cached_tokens(result.stats),
                  stats, prompt, tuple(result.token_ids), served)


def answers_tool_results(turn: ChatTurn) -> GenerationConfig:
    """``turn``'s generation, with at least one token where the turn answers tool results: an agent's model
    that ends its turn at once after a tool message answers ``''``, which every framework's loop takes for its
    final answer (issue 71: LlamaIndex's FunctionAgent on Qwen2.5-Coder-1.5B, its response ``''`` after the
    right tool result). ``min_new_tokens`` set by the caller is kept."""
    generation = turn.generation
    last = (turn.messages or [{}])[-1]
    if generation.min_new_tokens or last.get("role") != "tool":
        return generation
    return replace(generation, min_new_tokens=1)


def cached_tokens(stats: Any) -> int:
    """Prompt tokens whose K/V came from a cache (the store, the prefix or segment cache) and was kept as is:
    the blend's reused tokens less those of chunks it computed for this request on a miss (``BlendStats``)."""
    computed_here = max(0, stats.cached_tokens - stats.loaded_tokens)
    return max(0, stats.reused_tokens - computed_here)


def _deltas(reasoning: str, text: str) -> Iterator[TurnEvent]:
    if reasoning:
        yield ReasoningDelta(reasoning)
    if text:
        yield TextDelta(text)


__all__ = ["answers_tool_results", "appears_in", "ChatTurn", "Document", "ReasoningDelta", "TextDelta", "ToolCalls",
           "TurnEnd", "TurnEvent", "cached_tokens", "render_documents", "render_turn", "run_turn", "template_takes_documents"]
