"""Engines, locks and chunk caches shared by every ChatCacheBlend of a process.

Loading a model takes seconds and its chunk KV takes memory, so two chat models
naming the same model share one engine, one lock and one chunk cache per store.
The lock serialises all use of an engine: its tokenizer is not safe to call from
two threads at once, and one CPU/GPU gains nothing from interleaving two decodes.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.store import ChunkCache, KVStore

# Tiny random models from cacheblend_rag.testing: a full pipeline in milliseconds, for tests.
TINY_MODEL_PREFIX = "tiny-"
TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class EngineSlot:
    engine: CacheBlendEngine
    lock: threading.RLock = field(default_factory=threading.RLock)
    chunk_caches: dict[tuple[str | KVStore | None, tuple[int, ...]], ChunkCache] = field(default_factory=dict)


_registry_lock = threading.Lock()
_engines_by_key: dict[tuple[str, str | None, str | None], CacheBlendEngine] = {}
_slots: "weakref.WeakKeyDictionary[CacheBlendEngine, EngineSlot]" = weakref.WeakKeyDictionary()


def is_tiny_model_name(model: str) -> bool:
    return model.startswith(TINY_MODEL_PREFIX) and not os.path.exists(model)


def _load(model: str, device: str | None, dtype: str | None) -> CacheBlendEngine:
    if is_tiny_model_name(model):
        from cacheblend_rag.testing import tiny_engine

        arch = model[len(TINY_MODEL_PREFIX):]
        if arch not in TINY_ARCHITECTURES:
            raise ConfigError(
                f"model={model!r} is not a known tiny test model; choose one of "
                f"{', '.join(TINY_MODEL_PREFIX + a for a in TINY_ARCHITECTURES)}, or pass a real model"
            )
        engine = tiny_engine(arch)
        if device is not None:
            engine.model.to(device)
            engine.device = next(engine.model.parameters()).device
        return engine
    name_or_path = None if model == DEFAULT_MODEL_NAME else model
    return CacheBlendEngine.from_pretrained(name_or_path, device=device, dtype=dtype)


def load_engine(model: str, *, device: str | None = None, dtype: str | None = None) -> CacheBlendEngine:
    """The process-wide engine for ``model`` (loaded on first use)."""
    key = (model, device, dtype)
    with _registry_lock:
        engine = _engines_by_key.get(key)
        if engine is None:
            engine = _load(model, device, dtype)
            _engines_by_key[key] = engine
        return engine


def slot_for(engine: CacheBlendEngine) -> EngineSlot:
    """The lock and chunk caches that go with ``engine`` (also for engines built by the caller)."""
    with _registry_lock:
        slot = _slots.get(engine)
        if slot is None:
            slot = _slots[engine] = EngineSlot(engine)
        return slot


def chunk_cache_for(
    engine: CacheBlendEngine, store: str | KVStore | None, prefix_ids: tuple[int, ...] = ()
) -> ChunkCache:
    """The chunk cache of ``engine`` on ``store`` (an ``open_store`` spec or a store; ``None``: memory),
    computing chunks behind ``prefix_ids``."""
    slot = slot_for(engine)
    with slot.lock:
        cache = slot.chunk_caches.get((store, prefix_ids))
        if cache is None:
            cache = slot.chunk_caches[(store, prefix_ids)] = ChunkCache(engine, store, prefix_ids=prefix_ids)
        return cache
