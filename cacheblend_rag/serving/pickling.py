"""Integration objects pickle without their model, and find it again where they are unpickled.

``IngestionPipeline(num_workers=2)`` pickles its transformations (and so their ``CacheBlendLLM``) into
every worker, and other frameworks pickle LLM objects to ship or cache them. Pickled whole, a
``CacheBlendLLM`` over SmolLM2-135M is 514 MB, its copy holds a second model (which warns that its
weights changed) and its caches and scheduler thread do not survive the trip. So
:class:`PicklesWithoutEngine` leaves the engine, the chunk cache and the serving objects out (a
pickle of a few KB) and writes down how to find them again: on first use the unpickled object
attaches to the same engine and chunk cache if they are alive in this process, else loads the
engine through the registry (once per process, shared with every object naming the same model) and
opens its chunk cache from its own fields. An engine or chunk cache the caller built cannot be loaded
elsewhere: using such an object in another process is an error saying what to do instead.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, PrivateAttr

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.serving.registry import EngineRecipe, recipe_of, shared_engine, slot_for
from cacheblend_rag.store import MemoryKVStore

logger = logging.getLogger(__name__)

# Fields and private attributes that hold the model and what serves it: never pickled.
_ENGINE_FIELDS = ("engine", "chunk_cache")
_SERVING_PRIVATE = ("_service", "_calibration", "_calibration_lookup")
_ATTACHED_NAMES = frozenset((*_ENGINE_FIELDS, *_SERVING_PRIVATE))

# This process's engines and chunk caches that pickled objects refer to, by token: an object
# unpickled in the same process finds the very objects again (also ones the caller built).
_live: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_attach_lock = threading.RLock()


@dataclass(frozen=True)
class Attachment:
    """How an unpickled object finds its engine and chunk cache: by token in the process that pickled
    it (``pid``), else by loading ``recipe`` (``None``: an engine the caller built) and, where
    ``reopen_cache``, opening the chunk cache its own fields name."""

    pid: int
    engine_token: str
    cache_token: str
    recipe: Optional[EngineRecipe]
    reopen_cache: bool


def _token_for(thing: Any) -> str:
    token = uuid.uuid4().hex
    _live[token] = thing
    return token


class PicklesWithoutEngine(BaseModel):
    """A pydantic model whose ``engine`` and ``chunk_cache`` fields and serving state stay behind when it
    is pickled, and are attached again on first use (:mod:`~cacheblend_rag.serving.pickling`). The
    subclass provides ``_open_service()`` (the serving state from the fields and the attached engine)."""

    _attachment: Optional[Attachment] = PrivateAttr(default=None)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if "engine" not in self.__dict__:  # pickled again before its first use: as it came
            return state
        if self.__dict__.get("base_url") is not None:  # a server's client: no engine to find again, its own client
            private = {k: v for k, v in (state.get("__pydantic_private__") or {}).items()
                       if k not in ("_remote", "_remote_announced")}
            return {**state, "__pydantic_private__": private}
        state["__dict__"] = {k: v for k, v in state["__dict__"].items() if k not in _ENGINE_FIELDS}
        private = {k: v for k, v in (state.get("__pydantic_private__") or {}).items() if k not in _SERVING_PRIVATE}
        private["_attachment"] = self._attachment_here()
        state["__pydantic_private__"] = private
        return state

    def __deepcopy__(self, memo: Optional[dict[int, Any]] = None) -> "PicklesWithoutEngine":
        """A copy that shares the model: as pickled and unpickled in this process (its settings deep-copied,
        the same engine and chunk cache attached on first use, its own serving state). pydantic's would copy
        the engine's locks and fail (``model_copy(deep=True)`` and ``copy.deepcopy`` both come here)."""
        copied = type(self).__new__(type(self))
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        # pydantic's own, also where a framework base (LlamaIndex's BaseComponent re-runs __init__, which
        # would load the model now and mark every field as set by the user) comes first.
        BaseModel.__setstate__(self, state)
        if self.__dict__.get("base_url") is not None:  # a server's client has no engine to attach
            self.__dict__.setdefault("engine", None)
            self.__dict__.setdefault("chunk_cache", None)
            private = self.__pydantic_private__
            defaults = type(self).__private_attributes__
            for key in ("_remote", "_remote_announced", *_SERVING_PRIVATE):
                if key in defaults:
                    private.setdefault(key, defaults[key].get_default())

    def __getattr__(self, name: str) -> Any:
        # Fields live in __dict__ and are found without this; an unpickled object lacks these until used.
        if name in _ATTACHED_NAMES and "engine" not in self.__dict__:
            attach(self)
            return getattr(self, name)
        return super().__getattr__(name)  # type: ignore[misc]

    @property
    def engine_attached(self) -> bool:
        """Whether the model is attached (``False`` for an unpickled object not used yet)."""
        return "engine" in self.__dict__

    def attach_engine(self, engine: Any = None, chunk_cache: Any = None) -> None:
        """Attach an unpickled object now (not on first use): to ``engine`` and ``chunk_cache`` where given
        (the way to use, in another process, an object built around an engine or cache of the caller's),
        else to the ones it was pickled with. An object already attached keeps its own."""
        if self.engine_attached:
            if (engine is not None and engine is not self.__dict__["engine"]) or (
                    chunk_cache is not None and chunk_cache is not self.__dict__.get("chunk_cache")):
                raise ConfigError(f"this {type(self).__name__} already has its engine and chunk cache; build "
                                  "another one for another engine")
            return
        attach(self, engine, chunk_cache)

    def _attachment_here(self) -> Attachment:
        engine, cache = self.__dict__["engine"], self.__dict__.get("chunk_cache")
        recipe = recipe_of(engine)
        store_path = self.__dict__.get("store_path")
        # Reopened from the fields only when they name it: the registry opened it for this store spec.
        slot = slot_for(engine)
        with slot.lock:
            reopen = any(held is cache and key[0] == store_path for key, held in slot.chunk_caches.items())
        return Attachment(os.getpid(), _token_for(engine), _token_for(cache), recipe, reopen)


def attach(owner: PicklesWithoutEngine, engine: Any = None, chunk_cache: Any = None) -> None:
    """Give an unpickled ``owner`` its engine and chunk cache (``engine``/``chunk_cache`` if given, else the
    ones it was pickled with, found or loaded again) and its serving state. Raises ``ConfigError``,
    saying what to do, where they cannot be had here."""
    with _attach_lock:
        if "engine" in owner.__dict__:
            return
        attachment: Optional[Attachment] = owner.__pydantic_private__.get("_attachment")
        name = type(owner).__name__
        here = attachment is not None and attachment.pid == os.getpid()
        if engine is None and here:
            engine = _live.get(attachment.engine_token)
            chunk_cache = chunk_cache if chunk_cache is not None else _live.get(attachment.cache_token)
        if engine is None:
            if attachment is None or attachment.recipe is None:
                raise ConfigError(
                    f"this {name} was unpickled without its model: it was built around an engine passed as "
                    f"engine=, which is not pickled (a model is hundreds of MB) and cannot be loaded again "
                    f"here. Call .attach_engine(engine) on it with an engine of this process, or build the "
                    f"{name} where it is used (in the worker) from model=..., which each process loads once")
            recipe = attachment.recipe
            engine = shared_engine(recipe.model, device=recipe.device, dtype=recipe.dtype,
                                   tokenizer=recipe.tokenizer, model_kwargs=recipe.model_kwargs)
        if chunk_cache is None and attachment is not None and not attachment.reopen_cache:
            raise ConfigError(
                f"this {name} was unpickled without its chunk cache: it was built with chunk_cache= (a cache "
                f"its store_path does not name), which is not pickled. Call .attach_engine(engine, chunk_cache) "
                f"on it, or build the {name} where it is used with store_path= naming the store")
        if chunk_cache is not None and chunk_cache.engine is not engine:
            raise ConfigError(f"{name}: the chunk cache given belongs to another engine; pass that cache's engine")
        private = owner.__pydantic_private__
        default = type(owner).__private_attributes__
        for key in ("_calibration", "_calibration_lookup"):
            private[key] = default[key].get_default()
        owner.__dict__.update(engine=engine, chunk_cache=chunk_cache)
        try:
            private["_service"] = owner._open_service()  # type: ignore[attr-defined]
        except BaseException:
            for key in _ENGINE_FIELDS:
                owner.__dict__.pop(key, None)
            raise
        if not here and isinstance(owner.__dict__["chunk_cache"].store, MemoryKVStore):
            logger.warning("%s was unpickled in another process with chunk KV in memory: what it computes here "
                           "stays in this process. Give it a store_path (a folder, redis://...) to share chunk KV "
                           "between processes", name)
