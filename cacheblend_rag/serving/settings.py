"""The settings both integrations share, declared once as pydantic fields, in groups.

``CacheBlendLLM`` (LlamaIndex) and ``ChatCacheBlend`` (LangChain) inherit
:class:`CacheBlendSettings` beside their framework's base class, so they expose the same
fields with the same defaults, validated the same way. The fields are declared in groups
(:mod:`~cacheblend_rag.serving.setting_groups`: loading, storage, caches, scheduling, blending, sampling),
which :class:`CacheBlendSettings` is made of: the flat names (``recompute_ratio=0.2``) are its fields, and
each group is a property (``llm.blending``) and an argument (``blending=BlendingSettings(...)`` or a dict).
Unknown keywords are an error that suggests the closest known one (:mod:`~cacheblend_rag.serving.arguments`
checks the names and reads the Hugging Face spellings). The answer's length keeps each framework's own name
(``max_new_tokens`` in LlamaIndex, ``max_tokens`` in LangChain) and lives in the integrations.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, ClassVar, Iterator, Optional

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from cacheblend_rag.calibration.lookup import CalibratedSetting, CalibrationLookup, describe_config
from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine, build_strategy
from cacheblend_rag.errors import ConfigError, UnsupportedArchitectureError
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.reuse.prompt import default_conditioning_prefix
from cacheblend_rag.serving.arguments import (
    BLEND_FIELDS,
    SAMPLING_FIELDS,
    hugging_face_spellings,
    unknown_names_error,
    with_generate_kwargs,
)
from cacheblend_rag.serving.chat_turn import ChatTurn, TurnEvent, appears_in, run_turn
from cacheblend_rag.reuse.announced import AnnouncedChunks
from cacheblend_rag.serving.pickling import PicklesWithoutEngine
from cacheblend_rag.serving.registry import chunk_cache_for, prefix_cache_for, scheduler_for, segment_cache_for
from cacheblend_rag.serving.registry import shared_engine
from cacheblend_rag.serving.remote import RemoteChat
from cacheblend_rag.serving.service import BlendService, Served
from cacheblend_rag.serving.setting_groups import (
    CALIBRATED_CHOICES,
    GROUPS,
    BlendingSettings,
    CacheSettings,
    LoadingSettings,
    SamplingSettings,
    SchedulingSettings,
    SettingsGroup,
    StorageSettings,
)
from cacheblend_rag.store import ChunkCache, WarmSummary, parse_size
from cacheblend_rag.store.store_key import require_store_key, store_key

logger = logging.getLogger(__name__)


def _flattened(owner: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each group given by name (``storage=StorageSettings(...)`` or a dict of its fields)
    turned into the flat fields it sets; a field given both ways must agree."""
    flat = {k: v for k, v in values.items() if k not in GROUPS}
    for name in [k for k in values if k in GROUPS]:
        group_class, given = GROUPS[name], values[name]
        if isinstance(given, group_class):
            fields = {field: getattr(given, field) for field in given.model_fields_set}
        elif isinstance(given, dict):
            unknown = sorted(set(given) - set(group_class.model_fields))
            if unknown:
                raise unknown_names_error(f"{owner}'s {name}", unknown, set(group_class.model_fields), what="field")
            fields = dict(given)
        else:
            raise ConfigError(f"{owner}({name}=...) takes a {group_class.__name__} or a dict of its fields, "
                              f"not {type(given).__name__}")
        clash = sorted(f for f in fields if f in flat and flat[f] != fields[f])
        if clash:
            raise ConfigError(f"{owner} got {clash[0]} both as an argument and in {name}= with another value; "
                              "give it once")
        flat.update(fields)
    return flat


class CacheBlendSettings(LoadingSettings, StorageSettings, CacheSettings, SchedulingSettings, BlendingSettings,
                         SamplingSettings, PicklesWithoutEngine):
    """Which model, where its chunk KV lives, and how prompts are blended: the groups of
    :mod:`~cacheblend_rag.serving.setting_groups`, with the engine and chunk cache a caller may hand over.
    Pickled without the model, which an unpickled object attaches again on first use
    (:mod:`~cacheblend_rag.serving.pickling`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), hide_input_in_errors=True)

    # Standard parameters of hosted models that a subclass accepts and ignores.
    _ignored_init_args: ClassVar[frozenset[str]] = frozenset()

    # --- objects in hand rather than settings: never dumped, never pickled (attached again on first use)
    engine: Optional[CacheBlendEngine] = Field(
        default=None, exclude=True, repr=False,
        description="An engine built by the caller, used instead of loading `model` (which then defaults to its name).",
    )
    chunk_cache: Optional[ChunkCache] = Field(
        default=None, exclude=True, repr=False,
        description="A chunk cache of `engine` to use instead of opening `store_path`.",
    )
    _max_tokens_field: ClassVar[str] = "max_new_tokens"

    _service: Optional[BlendService] = PrivateAttr(default=None)
    _remote: Optional[RemoteChat] = PrivateAttr(default=None)
    _remote_announced: Optional[AnnouncedChunks] = PrivateAttr(default=None)
    _calibration: Optional[CalibratedSetting] = PrivateAttr(default=None)
    _calibration_lookup: CalibrationLookup = PrivateAttr(default=CalibrationLookup(None))

    # ------------------------------------------------------------------ validation
    @model_validator(mode="before")
    @classmethod
    def _known_arguments_only(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        given = _flattened(cls.__name__, {k: v for k, v in values.items() if k not in cls._ignored_init_args})
        values = hugging_face_spellings(cls.__name__, given, cls._max_tokens_field, logger)
        allowed = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise unknown_names_error(cls.__name__, unknown, allowed)
        if values.get("model") is None:
            engine = values.get("engine")
            values["model"] = engine.model_name if engine is not None else DEFAULT_MODEL_NAME
        # The groups' own before-validators (a base class's run after a subclass's) take it from here, on these
        # flat values: the store password moved apart, the blend and sampling fields checked as given.
        return values









    @model_validator(mode="after")
    def _validate_then_open(self) -> "CacheBlendSettings":
        # ConfigError is a ValueError, so pydantic reports it with the field, value and allowed range.
        build_strategy(self.blend_config)
        # The sampling fields, checked by GenerationConfig against the answer's length when it is set.
        self.generation_config_with(getattr(self, self._max_tokens_field, None) or max(1, self.min_new_tokens), None, {})
        self._validate_settings()
        if self.require_store_key and self.base_url is None:  # before the model loads; remote: the server's store
            self._check_store_key()
        if self.base_url is not None:  # the model is the server's: nothing is loaded here
            self._remote_announced = AnnouncedChunks(self.max_announced_chunks)
            return self
        # Only now, with every setting checked, is the model loaded (seconds) and the store opened.
        self._service = self._open_service()
        self.engine.plan(self.blend_config)  # the check layer against this model's depth
        return self

    def _validate_settings(self) -> None:
        """Checks of a subclass's own settings, run before the model is loaded."""

    def _check_store_key(self) -> None:
        if self.chunk_cache is not None:  # the cache given decides
            has_key = self.chunk_cache.tagger.authenticated
        else:
            has_key = store_key(self.store_key.get_secret_value() if self.store_key is not None else None) is not None
        require_store_key(has_key, "require_store_key=True")

    def _open_service(self) -> BlendService:
        if self.engine is None:
            self.engine = shared_engine(self.model, device=self.device, dtype=self.dtype,
                                        tokenizer=self.tokenizer_name, model_kwargs=self.model_kwargs,
                                        show_progress=self.show_progress or None)
        engine = self.engine
        if engine.adapter is None and not self.fallback_to_full_prefill:
            raise UnsupportedArchitectureError(
                f"{engine.unsupported_reason}; set fallback_to_full_prefill=True to serve this model "
                "with full prefill (no KV reuse)"
            )
        # Read once: the chunk cache's prefix follows it, and a setting must not change under a live object.
        if engine.adapter is not None and not self.model_fields_set & CALIBRATED_CHOICES:
            # The engine's lookup: its fingerprint's setting, else its weights' measured in another dtype.
            self._calibration_lookup = engine.calibration_lookup(self.calibration_dir or engine.calibration_dir)
            self._calibration = self._calibration_lookup.setting
        if self.chunk_cache is None:
            prefix = default_conditioning_prefix(engine.tokenizer) if self.conditions_chunks else ()
            key = self.store_key.get_secret_value() if self.store_key is not None else None
            password = self.store_password.get_secret_value() if self.store_password is not None else None
            self.chunk_cache = chunk_cache_for(engine, self.store_path, prefix_ids=prefix,
                                               size_limit=self.store_size_limit, storage_dtype=self.storage_dtype,
                                               auth_key=key, resident_bytes=self.resident_bytes,
                                               store_password=password)
        prefix_cache = prefix_cache_for(engine, self.chunk_cache, parse_size(self.prefix_cache_bytes),
                                        in_store=self.prefix_cache_in_store)
        segment_cache = segment_cache_for(engine, parse_size(self.segment_cache_bytes))
        limits = {name: int(value) for name in ("max_queued_requests", "kv_budget_bytes")
                  if (value := getattr(self, name)) is not None}
        if limits:
            scheduler_for(engine).configure(**limits)
        return BlendService(engine, self.chunk_cache, AnnouncedChunks(self.max_announced_chunks), prefix_cache,
                            segment_cache, chunk_sharing=self.chunk_sharing,
                            document_special_tokens=self.document_special_tokens)

    # ------------------------------------------------------------------ groups
    def _group(self, group_class: type[SettingsGroup]) -> Any:
        # Values already checked: a copy of them, keeping which were set (the calibration reads that).
        values = {name: getattr(self, name) for name in group_class.model_fields}
        return group_class.model_construct(_fields_set=self.model_fields_set & set(values), **values)

    @property
    def loading(self) -> LoadingSettings:
        """Which model, and how it loads (a copy: set the fields on this object to change them)."""
        return self._group(LoadingSettings)

    @property
    def storage(self) -> StorageSettings:
        """Where chunk K/V lives (a copy)."""
        return self._group(StorageSettings)

    @property
    def caches(self) -> CacheSettings:
        """Which prompt K/V is reused, how much is kept, and what tenants share (a copy)."""
        return self._group(CacheSettings)

    @property
    def scheduling(self) -> SchedulingSettings:
        """The engine's scheduler limits (a copy)."""
        return self._group(SchedulingSettings)

    @property
    def blending(self) -> BlendingSettings:
        """The blend fields as given (a copy; :attr:`blend_config` is the setting in force, calibration included)."""
        return self._group(BlendingSettings)

    @property
    def sampling(self) -> SamplingSettings:
        """How answers are sampled (a copy)."""
        return self._group(SamplingSettings)

    # ------------------------------------------------------------------ configs
    @property
    def calibration(self) -> Optional[CalibratedSetting]:
        """The saved calibration in force: the model's, found when this object opened, unless a blend
        field or ``condition_chunks`` is set (then the user's setting is)."""
        return None if self.model_fields_set & CALIBRATED_CHOICES else self._calibration

    @property
    def config_source(self) -> str:
        """Where the blend setting comes from: ``"user"``, ``"calibrated: <file>"``, ``"calibrated (shipped):
        <file>"`` (the package's own for this model), either noting ``measured in <dtype>`` when the engine
        computes in another, or ``"built-in"`` (``"built-in (<why>)"`` when a calibration cannot be used);
        with ``base_url``, ``"server: <base_url>"`` (the server's setting: each response's stats name it)."""
        if self.model_fields_set & CALIBRATED_CHOICES:
            return "user"
        if self.base_url is not None:
            return f"server: {self.base_url}"
        return self._calibration_lookup.source

    @property
    def conditions_chunks(self) -> bool:
        """Whether chunks are computed behind a prefix: ``condition_chunks``, or the calibration's choice."""
        calibrated = self.calibration
        return calibrated.condition_chunks if calibrated is not None else self.condition_chunks

    @property
    def blend_config(self) -> BlendConfig:
        """The setting calls use: these fields, or the saved calibration's (:attr:`config_source`)."""
        config = BlendConfig(**{name: getattr(self, name) for name in BLEND_FIELDS})
        calibrated = self.calibration
        return calibrated.apply_to(config) if calibrated is not None else config

    def blend_config_with(self, overrides: dict[str, Any]) -> BlendConfig:
        """This object's blend config with per-call ``overrides`` (BlendConfig fields) applied."""
        config = self.blend_config.with_overrides(**overrides) if overrides else self.blend_config
        build_strategy(config)
        return config

    @property
    def service(self) -> BlendService:
        if self._service is None and self.base_url is not None:
            raise ConfigError(f"this {type(self).__name__} answers through the server at {self.base_url} and has "
                              "no engine here; drop base_url to load the model in process for this")
        return self._service

    # ------------------------------------------------------------------ turns
    @property
    def is_remote(self) -> bool:
        """Whether the model answers in a server (``base_url``) rather than in this process."""
        return self.base_url is not None

    @property
    def remote(self) -> RemoteChat:
        """The client of the server at ``base_url`` (made on first use, so an unpickled object makes its own)."""
        if self.base_url is None:
            raise ConfigError(f"this {type(self).__name__} has no base_url: it answers in process")
        if self._remote is None:
            key = self.api_key.get_secret_value() if self.api_key is not None else os.environ.get("CACHEBLEND_API_KEY")
            # The default name is filled in when none is given: then whatever model the server serves.
            model = None if self.model == DEFAULT_MODEL_NAME else self.model
            self._remote = RemoteChat(self.base_url, api_key=key, model=model)
        return self._remote

    @property
    def announced(self) -> AnnouncedChunks:
        """The chunk texts announced to this object (by its retriever or postprocessor)."""
        if self.base_url is not None:
            if self._remote_announced is None:  # unpickled
                self._remote_announced = AnnouncedChunks(self.max_announced_chunks)
            return self._remote_announced
        return self.service.announced

    def explicit_blend_options(self) -> dict[str, Any]:
        """The blend fields set on this object, which a server request carries (the server's own otherwise)."""
        return {name: getattr(self, name) for name in BLEND_FIELDS if name in self.model_fields_set}

    def run_turn(self, turn: ChatTurn) -> Iterator[TurnEvent]:
        """``turn`` answered in process or by the server at ``base_url``: the same events either way
        (:mod:`~cacheblend_rag.serving.chat_turn`). Remotely, the announced chunk texts found verbatim in the
        messages go as the request's documents (the server looks for those only). A turn without a
        ``cache_salt`` of its own takes this object's."""
        if turn.cache_salt is not None and not isinstance(turn.cache_salt, str):
            raise ConfigError(f"cache_salt={turn.cache_salt!r} must be a string (a tenant's name, say), '' for none")
        if turn.cache_salt is None and self.cache_salt:
            turn = replace(turn, cache_salt=self.cache_salt)
        if self.base_url is None:
            return run_turn(self, turn)
        if not turn.documents:
            turn = replace(turn, documents=[t for t in self.announced.known() if appears_in(t, turn)])
        if turn.reuse is None and "reuse_chunk_kv" in self.model_fields_set:
            turn = replace(turn, reuse=self.reuse_chunk_kv)
        return self.remote.run_turn(turn, self.explicit_blend_options())

    def stats_of(self, served: Served) -> dict[str, Any]:
        """The stats a response carries: ``served``'s, with chunks the retrieval side computed for this
        request (``precomputed_for_request``) told apart from store hits (``cache_hits``)."""
        stats = self._service.announced.account(served.stats(), served.prompt.segments)
        # The engine saw a config passed in ("user"); where it came from is known here. A call that
        # overrode the setting ran another one than this object's.
        own = stats.get("blend_setting") == describe_config(self.blend_config)
        stats["config_source"] = self.config_source if own else "user"
        stats["condition_chunks"] = bool(self._service.chunk_cache.prefix_ids)
        return stats

    def precompute_texts(self, texts: list[str], *, show_progress: bool, for_request: bool) -> WarmSummary:
        """Compute and store the KV of the chunk texts the store lacks; ``for_request``: for the coming
        request (the retrieval side at query time), whose stats then count those chunks apart."""
        if self.base_url is not None:
            counts = self.remote.warm(texts, cache_salt=self.cache_salt)
            return WarmSummary(new=int(counts.get("computed") or 0), present=int(counts.get("already_stored") or 0))
        summary = self._service.warm(texts, show_progress=show_progress, salt=self.cache_salt or "")
        if for_request:
            self._service.announced.note_computed(summary.computed)
        return summary

    def generation_config_with(self, max_new_tokens: int, stop: Optional[list], overrides: dict[str, Any]
                               ) -> GenerationConfig:
        """The generation config of one call: these fields and ``generate_kwargs``, then the call's ``overrides``."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        values.update({k: v for k, v in overrides.items() if k in SAMPLING_FIELDS and v is not None})
        values.update(max_new_tokens=max_new_tokens, stop=tuple(stop or ()))
        return GenerationConfig(**with_generate_kwargs(type(self).__name__, values, self.generate_kwargs, overrides))


__all__ = ["BLEND_FIELDS", "CacheBlendSettings", "ConfigError", "SAMPLING_FIELDS", "unknown_names_error"]
