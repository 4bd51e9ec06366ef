"""The request bodies the server takes, as pydantic models in OpenAI's shapes (and vLLM's extras).

Types are checked here (a wrong one is a 400 naming the field); what a value means is checked where it is
used (:mod:`~cacheblend_rag.server.translate`), against the model and its window. Unknown top-level fields
are ignored, as OpenAI's clients send extras of their own; fields OpenAI defines that this server cannot
honour are declared, so that a value other than their neutral one is refused, never dropped.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    """A part of a request: unknown keys are ignored (clients add their own)."""

    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    """One part of a message's content: ``{"type": "text", "text": ...}`` (other types are refused)."""

    type: str
    text: Optional[str] = None


class FunctionCall(_Lenient):
    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"  # JSON text on the wire; a dict is taken too


class ToolCallIn(_Lenient):
    """A call an earlier assistant message made."""

    id: Optional[str] = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    """One message of the conversation: ``role`` is system, developer (read as system), user, assistant or tool."""

    # The schema names the roles and the non-empty list while translate.py checks them, so that its 400s name
    # the field and the value given (pydantic's own message would not); json_schema_extra is the schema's alone.
    role: str = Field(json_schema_extra={"enum": ["system", "developer", "user", "assistant", "tool"]})
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCallIn]] = None
    tool_call_id: Optional[str] = None


class DocumentIn(_Lenient):
    """A retrieved passage the request brings (vLLM's ``documents`` entries): one chunk each."""

    text: str
    title: Optional[str] = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    """``POST /v1/chat/completions``: OpenAI's fields, vLLM's sampling extras, ``documents`` and
    ``cache_salt``, and ``cacheblend`` (this server's per-request blend settings; docs/serving.md)."""

    model: Optional[str] = None
    messages: List[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[Dict[str, Any]] = None
    n: Optional[int] = None
    user: Optional[str] = None  # accepted, not used
    # OpenAI's, refused unless neutral (translate.refused_fields says why).
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None
    functions: Optional[List[Dict[str, Any]]] = None
    function_call: Union[str, Dict[str, Any], None] = None
    modalities: Optional[List[str]] = None
    audio: Optional[Dict[str, Any]] = None
    prediction: Optional[Dict[str, Any]] = None
    # vLLM's extras.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    documents: Optional[List[Union[DocumentIn, str]]] = None
    cache_salt: Optional[str] = None
    # Ours: BlendConfig fields for this request, "reuse" and "timeout" (keys checked in translate).
    cacheblend: Optional[Dict[str, Any]] = Field(default=None)


class WarmRequest(_Lenient):
    """``POST /v1/documents/warm``: documents whose K/V to compute into the store now."""

    documents: List[Union[DocumentIn, str]]
    cache_salt: Optional[str] = None


__all__ = ["ChatCompletionRequest", "ChatMessage", "ContentPart", "DocumentIn", "FunctionCall", "StreamOptions",
           "ToolCallIn", "WarmRequest"]
