"""Engines, schedulers and chunk caches shared by every integration object of a process.

Loading a model takes seconds and its chunk KV takes memory, so LLMs and chat models that
name the same model (and device and dtype) share one engine (however they spell it:
:mod:`~cacheblend_rag.serving.engine_key`), and those on the same engine
and store share one chunk cache. Each engine has one scheduler, whichever framework uses it,
whose worker thread is the only one to touch the engine: a torch model is not re-entrant,
its tokenizer is not safe to call from two threads at once, and concurrent requests are
decoded fastest as one batch (:mod:`~cacheblend_rag.serving.scheduler`).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from cacheblend_rag.config import BlendConfig, SchedulerConfig
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.reuse.prefix_cache import PrefixCache
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.serving.engine_key import (
    TINY_ARCHITECTURES,
    TINY_MODEL_PREFIX,
    EngineKey,
    engine_key,
    is_tiny_model_name,
    loader_device_argument,
    loader_model_argument,
)
from cacheblend_rag.serving.scheduler import RequestScheduler
from cacheblend_rag.reuse.segment_cache import SegmentCache
from cacheblend_rag.store import ChunkCache, KVStore, MemoryKVStore, open_store, parse_size
from cacheblend_rag.store.prefix_blocks import StorePrefixBlocks
from cacheblend_rag.store.urls import with_password

ChunkCacheKey = tuple[Any, ...]  # store, prefix, size limit, storage dtype, store key hash, tier size, password hash


@dataclass
class EngineSlot:
    """An engine with its scheduler and its chunk caches, one per store and prefix (``lock`` guards
    the chunk caches' table only; the engine's work goes through the scheduler)."""

    engine: CacheBlendEngine
    scheduler: RequestScheduler
    lock: threading.RLock = field(default_factory=threading.RLock)
    chunk_caches: dict[ChunkCacheKey, ChunkCache] = field(default_factory=dict)
    # One prefix cache per store the engine's chunk caches use (and whether it writes blocks through).
    prefix_caches: dict[tuple[int, bool], tuple[KVStore, PrefixCache]] = field(default_factory=dict)
    segment_cache: SegmentCache | None = None


@dataclass(frozen=True)
class EngineRecipe:
    """The arguments a registry engine was loaded with: enough to load it again in another process
    (an unpickled integration object does, :mod:`~cacheblend_rag.serving.pickling`)."""

    model: str
    device: str | None
    dtype: str | None
    tokenizer: str | None
    model_kwargs: dict[str, Any]


_registry_lock = threading.Lock()
_engines: dict[EngineKey, CacheBlendEngine] = {}
_recipes: "weakref.WeakKeyDictionary[CacheBlendEngine, EngineRecipe]" = weakref.WeakKeyDictionary()
_slots: "weakref.WeakKeyDictionary[CacheBlendEngine, EngineSlot]" = weakref.WeakKeyDictionary()


def tiny_engine_named(model: str) -> CacheBlendEngine:
    """A fresh engine over the tiny random model ``model`` names (``tiny-<arch>``; seeded, so every process
    builds the same weights); a name of no known architecture is a ``ConfigError`` listing the known ones."""
    from cacheblend_rag.engine.tiny import tiny_engine

    arch = model[len(TINY_MODEL_PREFIX):] if is_tiny_model_name(model) else ""
    if arch not in TINY_ARCHITECTURES:
        raise ConfigError(
            f"model={model!r} is not a known tiny test model; choose one of "
            f"{', '.join(TINY_MODEL_PREFIX + a for a in TINY_ARCHITECTURES)}, or pass a real model"
        )
    return tiny_engine(arch)


def _load(model: str, device: str | None, dtype: str | None, tokenizer: str | None,
          model_kwargs: dict[str, Any], show_progress: bool | None = None) -> CacheBlendEngine:
    if is_tiny_model_name(model):
        engine = tiny_engine_named(model)
        if device is not None:
            engine.model.to(device)
            engine.device = next(engine.model.parameters()).device
        return engine
    name_or_path = loader_model_argument(model)
    # Loaded for any settings: an architecture without an adapter is refused (or served by full
    # prefill) by each integration object according to its own fallback_to_full_prefill.
    return CacheBlendEngine.from_pretrained(name_or_path, device=device, dtype=dtype, tokenizer=tokenizer,
                                            model_kwargs=model_kwargs, config=BlendConfig(fallback_to_full_prefill=True),
                                            show_progress=show_progress)


def shared_engine(
    model: str, *, device: str | None = None, dtype: str | None = None, tokenizer: str | None = None,
    model_kwargs: dict[str, Any] | None = None, show_progress: bool | None = None,
) -> CacheBlendEngine:
    """The process-wide engine for ``model`` on ``device`` in ``dtype`` (loaded on first use).
    ``show_progress``: transformers' progress bars if this call loads it (not part of what names the engine).
    ``model`` is the embedded model's name, a catalog name, a folder, a ``.gguf`` file, a hub id or
    ``tiny-<arch>``; ``device`` ``None`` or ``"auto"`` is the best one here; ``tokenizer`` and
    ``model_kwargs`` as for :func:`cacheblend_rag.models.load_model`. Arguments that resolve to the same
    weights, device and dtype (``dtype=None`` and the dtype it picks, say) get the same engine."""
    options = dict(model_kwargs or {})
    key = engine_key(model, device, dtype, tokenizer, options)
    with _registry_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = _load(model, loader_device_argument(device), dtype, tokenizer, options,
                                           show_progress)
            _recipes[engine] = EngineRecipe(model, device, dtype, tokenizer, options)
        return engine


def release_engine(engine: CacheBlendEngine, timeout: float | None = 10.0) -> bool:
    """Let ``engine`` go: the registry forgets it (the next :func:`shared_engine` of its arguments loads the
    model again), its scheduler cancels what waits or runs and stops (its worker joined for up to ``timeout``
    seconds), and its chunk, prefix and segment caches are dropped. Its memory is freed once nothing else holds
    it: model objects built on it hold it too and cannot answer any more (their scheduler is closed); build new
    ones.
    A process serving several models one after another calls this to get each one's memory back. Returns
    whether the registry or a scheduler held it."""
    with _registry_lock:
        keys = [key for key, held in _engines.items() if held is engine]
        for key in keys:
            del _engines[key]
        _recipes.pop(engine, None)
        # The slot holds the engine itself, so the weak table alone would never let it go.
        slot = _slots.pop(engine, None)
    if slot is not None:
        slot.scheduler.close(timeout)
        with slot.lock:
            slot.chunk_caches.clear()
            slot.prefix_caches.clear()
            slot.segment_cache = None
    return bool(keys) or slot is not None


def recipe_of(engine: CacheBlendEngine) -> EngineRecipe | None:
    """How ``engine`` was loaded, if the registry loaded it (``None`` for an engine built by the caller)."""
    with _registry_lock:
        return _recipes.get(engine)


def slot_for(engine: CacheBlendEngine) -> EngineSlot:
    """The scheduler and chunk caches that go with ``engine`` (also for engines built by the caller)."""
    with _registry_lock:
        slot = _slots.get(engine)
        if slot is None:
            slot = _slots[engine] = EngineSlot(engine, RequestScheduler(engine))
        return slot


def scheduler_for(engine: CacheBlendEngine, config: SchedulerConfig | None = None) -> RequestScheduler:
    """The one scheduler of ``engine``; ``config`` changes its limits (from its next iteration on).
    A closed scheduler is replaced by a new one."""
    slot = slot_for(engine)
    with _registry_lock:
        if slot.scheduler.closed:
            slot.scheduler = RequestScheduler(engine, config)
        elif config is not None:
            slot.scheduler.configure(**asdict(config))
        return slot.scheduler


def chunk_cache_for(
    engine: CacheBlendEngine, store: str | KVStore | None, *, prefix_ids: Sequence[int] = (),
    size_limit: int | str | None = None, storage_dtype: str = "auto", auth_key: str | None = None,
    resident_bytes: int | str | None = None, store_password: str | None = None,
) -> ChunkCache:
    """The chunk cache of ``engine`` on ``store`` (an ``open_store`` spec or a store; ``None``:
    memory), computing chunks behind ``prefix_ids`` and storing them as ``storage_dtype``,
    authenticated with ``auth_key``, with a host-memory tier of ``resident_bytes`` (``None``: the
    device's default); one per engine, store, prefix, codec, key and tier size. ``store_password``
    goes into the spec's URL (in place of its ``***``) only to open it."""
    slot = slot_for(engine)
    prefix = tuple(int(t) for t in prefix_ids)
    # The store key's digest, not the key: a registry key is no place for a secret.
    key_digest = None if auth_key is None else hashlib.sha256(auth_key.encode()).hexdigest()
    password_digest = None if store_password is None else hashlib.sha256(store_password.encode()).hexdigest()
    resident = None if resident_bytes is None else parse_size(resident_bytes)
    key = (store, prefix, size_limit, storage_dtype, key_digest, resident, password_digest)
    with slot.lock:
        cache = slot.chunk_caches.get(key)
        if cache is None or cache.closed:  # a user closed it (to flush writes, say): open it anew
            spec = with_password(store, store_password) if isinstance(store, str) else store
            opened = store if isinstance(store, KVStore) else open_store(spec, size_limit=size_limit)
            cache = slot.chunk_caches[key] = ChunkCache(engine, opened, prefix_ids=prefix, storage_dtype=storage_dtype,
                                                        auth_key=auth_key, resident_bytes=resident)
        return cache


def prefix_cache_for(engine: CacheBlendEngine, chunk_cache: ChunkCache, max_bytes: int, *,
                     in_store: bool = False) -> PrefixCache | None:
    """The prefix cache of ``engine`` beside ``chunk_cache``'s store, holding at most ``max_bytes``
    (``None`` for 0, or an engine without a layer-wise adapter). Every integration object on one engine
    and store shares it, so prompts that share a lead share its K/V; asked again with a larger bound it
    grows to it. With ``in_store`` and a store other processes can reach (anything but process memory),
    blocks are also written to and read from the store, for replicas."""
    if max_bytes <= 0 or engine.adapter is None:
        return None
    slot = slot_for(engine)
    store = chunk_cache.store
    through = in_store and not isinstance(store, MemoryKVStore)
    key = (id(store), through)
    with slot.lock:
        held = slot.prefix_caches.get(key)
        if held is None or held[0] is not store:
            cache = PrefixCache(max_bytes, backing=StorePrefixBlocks(chunk_cache) if through else None)
            slot.prefix_caches[key] = (store, cache)
            return cache
        cache = held[1]
        if max_bytes > cache.max_bytes:
            cache.resize(max_bytes)
        return cache


def segment_cache_for(engine: CacheBlendEngine, max_bytes: int) -> SegmentCache | None:
    """The segment cache of ``engine`` (recent spans after the chunks, :mod:`~cacheblend_rag.reuse.segment_cache`),
    holding at most ``max_bytes``; ``None`` for 0 or an engine without a layer-wise adapter. One per engine,
    grown to the largest bound asked for."""
    if max_bytes <= 0 or engine.adapter is None:
        return None
    slot = slot_for(engine)
    fingerprint = engine.fingerprint
    with slot.lock:
        cache = slot.segment_cache
        if cache is None or cache.fingerprint != fingerprint:  # new weights: the old spans are another model's
            cache = slot.segment_cache = SegmentCache(max_bytes, fingerprint=fingerprint)
        elif max_bytes > cache.max_bytes:
            cache.max_bytes = max_bytes
        return cache
