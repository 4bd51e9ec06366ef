"""The settings in groups (issue 72, item 4): every field in one group, the flat names and the groups given as
arguments making the same object, each group a property, and ``cacheblend-rag serve``'s settings flags made from
the groups' ``server_flags``."""

from __future__ import annotations

import pytest

from cacheblend_rag.cli import build_parser
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.server.commands import _config
from cacheblend_rag.serving import CacheBlendSettings
from cacheblend_rag.serving.setting_groups import GROUPS, BlendingSettings, StorageSettings

IN_HAND = {"engine", "chunk_cache"}  # objects a caller hands over, not settings


def test_every_setting_is_in_exactly_one_group():
    grouped = [name for group in GROUPS.values() for name in group.model_fields]
    assert len(grouped) == len(set(grouped)), "a field in two groups"
    assert set(grouped) == set(CacheBlendSettings.model_fields) - IN_HAND
    assert set(CacheBlendSettings.model_fields) >= IN_HAND


@pytest.fixture(scope="module")
def engine():
    from cacheblend_rag.testing import tiny_engine

    return tiny_engine("llama")


def _same(a: CacheBlendSettings, b: CacheBlendSettings) -> None:
    assert a.model_dump() == b.model_dump()
    assert a.model_fields_set == b.model_fields_set


def test_a_group_given_as_an_argument_sets_the_same_fields_as_the_flat_names(engine):
    flat = CacheBlendSettings(engine=engine, recompute_ratio=0.3, selection="kv_deviation", store_path="memory")
    as_objects = CacheBlendSettings(engine=engine, blending=BlendingSettings(recompute_ratio=0.3,
                                                                            selection="kv_deviation"),
                                    storage=StorageSettings(store_path="memory"))
    as_dicts = CacheBlendSettings(engine=engine, blending={"recompute_ratio": 0.3, "selection": "kv_deviation"},
                                  storage={"store_path": "memory"})
    _same(flat, as_objects)
    _same(flat, as_dicts)
    # Fields set inside a group count as the user's: a saved calibration no longer applies.
    assert as_objects.config_source == flat.config_source == "user"
    assert as_objects.blend_config == flat.blend_config


def test_each_group_is_a_property_holding_its_fields(engine):
    settings = CacheBlendSettings(engine=engine, recompute_ratio=0.25, prefix_cache_bytes="8MB", temperature=0.0)
    assert settings.blending.recompute_ratio == 0.25
    assert settings.blending.model_fields_set == {"recompute_ratio"}
    assert settings.caches.prefix_cache_bytes == "8MB"
    assert settings.sampling.temperature == 0.0
    assert settings.loading.model == engine.model_name
    assert settings.scheduling.max_queued_requests is None
    assert settings.storage.storage_dtype == "auto"
    # A copy: a group read and changed leaves the object as it was.
    copy = settings.blending
    copy.recompute_ratio = 0.9
    assert settings.recompute_ratio == 0.25


def test_a_group_argument_that_is_wrong_says_what_is_wrong(engine):
    with pytest.raises(ValueError, match=r"unknown field\(s\) 'recompute_ration' \(did you mean 'recompute_ratio'\?\)"):
        CacheBlendSettings(engine=engine, blending={"recompute_ration": 0.2})
    with pytest.raises(ValueError, match="takes a BlendingSettings or a dict of its fields, not StorageSettings"):
        CacheBlendSettings(engine=engine, blending=StorageSettings())
    with pytest.raises(ValueError, match="recompute_ratio both as an argument and in blending="):
        CacheBlendSettings(engine=engine, recompute_ratio=0.2, blending={"recompute_ratio": 0.3})
    with pytest.raises(ValueError, match="recompute_ratio"):
        BlendingSettings(recompute_ratio=1.5)  # a group checks its fields alone too


def test_a_store_password_in_a_group_is_kept_apart(engine):
    group = StorageSettings(store_path="redis://:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in repr(group) and group.store_password.get_secret_value() == "s3cret"
    with pytest.raises(Exception) as refused:  # nothing listens there; the error must not show the password
        CacheBlendSettings(engine=engine, storage={"store_path": "redis://:s3cret@127.0.0.1:1/0"})
    assert "s3cret" not in str(refused.value)


# One value per server flag, as a user types it, and the field value it must set.
FLAG_VALUES = {
    "model": ("tiny-llama", "tiny-llama"), "dtype": ("float32", "float32"), "device": ("cpu", "cpu"),
    "store_path": ("memory", "memory"), "resident_bytes": ("16MB", "16MB"), "reuse_chunk_kv": (None, False),
    "chunk_sharing": ("per_salt", "per_salt"), "prefix_cache_bytes": ("8MB", "8MB"),
    "segment_cache_bytes": ("0", "0"), "document_special_tokens": ("control", "control"),
    "max_queued_requests": ("7", 7), "kv_budget_bytes": ("4GB", "4GB"), "recompute_ratio": ("0.2", 0.2),
    "check_layer": ("none", None), "gate": (None, True),
}


def test_every_group_flag_is_a_serve_flag_that_sets_its_field():
    parser = build_parser()
    serve_help = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for group in GROUPS.values():
        assert not group.server_flags or group.title in serve_help
        for name, spec in group.server_flags.items():
            assert name in group.model_fields, f"{group.__name__}.server_flags names no field {name!r}"
            assert spec.flag in serve_help
    flags = {name: spec for group in GROUPS.values() for name, spec in group.server_flags.items()}
    for name, (text, expected) in FLAG_VALUES.items():
        argv = ["serve", flags[name].flag] + ([text] if text is not None else [])
        config = _config(parser.parse_args(argv))
        got = {"model": config.model, "store_path": config.store}.get(name, config.settings.get(name))
        assert got == expected, f"{argv} set {name}={got!r}"
    assert _config(parser.parse_args(["serve"])).settings == {}  # no flag given, no field set


def test_a_bad_flag_value_names_the_flag_before_the_model_loads():
    parser = build_parser()
    with pytest.raises(ConfigError, match="--kv-budget"):
        _config(parser.parse_args(["serve", "--kv-budget", "lots"]))
    with pytest.raises(ConfigError, match="recompute_ratio"):
        _config(parser.parse_args(["serve", "--recompute-ratio", "2"]))


def test_both_integrations_take_the_groups_as_the_docs_write_them(engine):
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM

    from cacheblend_rag.serving import BlendingSettings as Exported

    for cls in (ChatCacheBlend, CacheBlendLLM):
        grouped = cls(engine=engine, blending=Exported(recompute_ratio=0.2), storage={"store_path": "memory"})
        flat = cls(engine=engine, recompute_ratio=0.2, store_path="memory")
        assert grouped.blending.recompute_ratio == flat.recompute_ratio == 0.2
        assert grouped.store_path == flat.store_path == "memory"
        assert grouped.config_source == flat.config_source == "user"
