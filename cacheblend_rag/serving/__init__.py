"""The serving layer both integrations stand on: shared settings, engines and locks, chunk texts,
and one path from a rendered prompt to a blended answer. The integrations are framework glue on top.

* :mod:`~cacheblend_rag.serving.settings`: :class:`CacheBlendSettings`, the pydantic fields both expose;
* :mod:`~cacheblend_rag.serving.arguments`: the names those fields take, checked (an unknown one names the
  closest known one), and the Hugging Face integrations' spellings read as them;
* :mod:`~cacheblend_rag.serving.registry`: one engine per model, one scheduler per engine, one chunk
  cache per engine and store;
* :mod:`~cacheblend_rag.serving.scheduler`: :class:`RequestScheduler`, the one worker thread of an
  engine, which blends requests as they come and decodes the running ones as one batch;
* :mod:`~cacheblend_rag.serving.admission`: the KV memory budget its running requests share, and who may start;
* :mod:`~cacheblend_rag.reuse.announced`: the normal form of a chunk's text and the announced texts;
* :mod:`~cacheblend_rag.reuse.segment_cache`: :class:`SegmentCache`, spans after the chunks kept as cached segments;
* :mod:`~cacheblend_rag.serving.service`: :class:`BlendService`, prompt in, answer and stats out;
* :mod:`~cacheblend_rag.serving.chat_turn`: :func:`run_turn`, one chat turn (messages, documents, tools,
  response format, timeout, cache salt) in, events out: what the HTTP server and both integrations stand on;
* :mod:`~cacheblend_rag.serving.remote`: :class:`RemoteChat`, the same turns answered by a running server.

The integrations import only the names this package exports (a test keeps it so).
"""

from cacheblend_rag.reuse.prompt import chunk_text, chunk_texts
from cacheblend_rag.reuse.announced import AnnouncedChunks
from cacheblend_rag.config import SchedulerConfig
from cacheblend_rag.serving.registry import (
    EngineSlot,
    chunk_cache_for,
    prefix_cache_for,
    release_engine,
    scheduler_for,
    segment_cache_for,
    shared_engine,
    slot_for,
)
from cacheblend_rag.serving.admission import KVBudgetError
from cacheblend_rag.reuse.segment_cache import SegmentCache
from cacheblend_rag.serving.scheduler import RequestCancelled, RequestHandle, RequestScheduler, SchedulerFullError
from cacheblend_rag.serving.service import BlendService, Served, ServedStream
from cacheblend_rag.reuse.plan import PreparedPrompt, PromptReuse
from cacheblend_rag.reuse.prefix_cache import PrefixCache, PrefixCacheStats
from cacheblend_rag.serving.arguments import BLEND_FIELDS, SAMPLING_FIELDS, call_answer_length, unknown_names_error
from cacheblend_rag.serving.settings import CacheBlendSettings
from cacheblend_rag.serving.setting_groups import (
    BlendingSettings,
    CacheSettings,
    LoadingSettings,
    SamplingSettings,
    SchedulingSettings,
    StorageSettings,
)
from cacheblend_rag.serving.chat_turn import (
    ChatTurn,
    Document,
    ReasoningDelta,
    TextDelta,
    ToolCalls,
    TurnEnd,
    TurnEvent,
    render_turn,
    run_turn,
)
from cacheblend_rag.serving.remote import RemoteChat, RemoteServerError
# What the integrations use beside the turn: the framework-neutral pieces of messages, tools and streams.
from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.concurrency import iterate_in_thread, run_in_thread
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.reuse.text import TokenCounter
from cacheblend_rag.errors import BlendInputError, ConfigError, ContextWindowError
from cacheblend_rag.serving.thinking import Thought, thinks
from cacheblend_rag.serving.tool_chat import assistant_turn, render_chat, tool_turn
from cacheblend_rag.serving.tools import ToolCall, chosen_tools, tool_functions, tools_instruction
from cacheblend_rag.store import ChunkCache, WarmSummary

__all__ = [
    "AnnouncedChunks", "BLEND_FIELDS", "SAMPLING_FIELDS", "BlendService", "PrefixCache", "PrefixCacheStats", "PromptReuse", "CacheBlendSettings", "EngineSlot", "KVBudgetError",
    "PreparedPrompt",
    "RequestCancelled", "RequestHandle", "RequestScheduler", "SchedulerConfig", "SchedulerFullError",
    "SegmentCache", "Served", "ServedStream", "chunk_cache_for", "prefix_cache_for", "segment_cache_for",
    "scheduler_for", "release_engine", "chunk_text", "chunk_texts", "shared_engine", "slot_for",
    "unknown_names_error", "call_answer_length", "BlendingSettings", "CacheSettings", "LoadingSettings",
    "SamplingSettings", "SchedulingSettings", "StorageSettings",
    "ChatTurn", "Document", "ReasoningDelta", "TextDelta", "ToolCalls", "TurnEnd", "TurnEvent", "render_turn",
    "run_turn", "RemoteChat", "RemoteServerError",
    "BlendConfig", "GenerationConfig", "TokenCounter", "iterate_in_thread", "run_in_thread", "CacheBlendEngine", "BlendInputError", "ContextWindowError",
    "ConfigError", "Thought", "thinks", "assistant_turn", "render_chat", "tool_turn", "ToolCall", "chosen_tools",
    "tool_functions", "tools_instruction", "ChunkCache", "WarmSummary",
]
