"""--methods parsing and method naming."""

from __future__ import annotations

import pytest

from cacheblend_rag.bench.methods import MethodSpec, parse_methods, parse_ratios, with_references
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.calibration.lookup import describe_config
from cacheblend_rag.engine.selection import available_strategies
from cacheblend_rag.errors import ConfigError


def names(specs):
    return [s.name for s in specs]


def test_default_methods_expand_over_ratios():
    specs = parse_methods("full_prefill,prefix_caching,full_reuse,cacheblend", [0.05, 0.15, 0.3])
    assert names(specs) == [
        "full_prefill", "prefix_caching", "full_reuse", "cacheblend@0.05", "cacheblend@0.15", "cacheblend@0.3",
    ]
    blend = specs[4]
    assert (blend.kind, blend.selection, blend.ratio, blend.prefix_conditioned) == ("blend", "kv_deviation", 0.15, False)


def test_kv_deviation_is_cacheblend_and_strategies_keep_their_names():
    specs = parse_methods("cacheblend,kv_deviation,sink_aware", [0.15])
    assert names(specs) == ["cacheblend@0.15", "sink_aware@0.15"]


def test_prefix_suffix_pin_and_modes():
    assert names(parse_methods("cacheblend+prefix@0.15", [0.05, 0.3])) == ["cacheblend+prefix@0.15"]
    both = parse_methods("full_prefill,full_reuse,gradual", [0.15], prefix_conditioned="both")
    assert names(both) == ["full_prefill", "full_reuse", "full_reuse+prefix", "gradual@0.15", "gradual+prefix@0.15"]
    on = parse_methods("full_reuse,query_aware", [0.15], prefix_conditioned="on")
    assert names(on) == ["full_reuse+prefix", "query_aware+prefix@0.15"]
    assert all(s.prefix_conditioned for s in on)


def test_all_covers_every_registered_strategy():
    specs = parse_methods("all", [0.15])
    selections = {s.selection for s in specs if s.kind == "blend"}
    assert selections == set(available_strategies())
    assert {"full_prefill", "prefix_caching", "full_reuse"} <= set(names(specs))


@pytest.mark.parametrize(
    "text, message",
    [
        ("full_prefil", "unknown method"),
        ("full_prefill+prefix", "takes neither"),
        ("prefix_caching@0.1", "takes neither"),
        ("full_reuse@0.1", "ratio 0 by definition"),
        ("", "empty"),
        ("cacheblend@2", "out of range"),
    ],
)
def test_bad_methods_say_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_methods(text, [0.15])


def test_parse_ratios():
    assert parse_ratios("0.05, 0.15,0.3,0.15") == [0.05, 0.15, 0.3]
    with pytest.raises(ConfigError, match="full_reuse"):
        parse_ratios("0")
    with pytest.raises(ConfigError, match="not a number"):
        parse_ratios("0.1,x")


def test_references_are_added_once():
    specs, added = with_references(parse_methods("cacheblend", [0.15]))
    assert names(specs) == ["full_prefill", "full_reuse", "cacheblend@0.15"]
    assert names(added) == ["full_prefill", "full_reuse"]
    specs, added = with_references(parse_methods("full_prefill,prefix_caching", [0.15]))
    assert names(specs) == ["full_prefill", "prefix_caching"] and added == []


def test_blend_config_per_method():
    base = BlendConfig(check_layer=2)
    assert MethodSpec("full_reuse").blend_config(base).recompute_ratio == 0.0
    cfg = MethodSpec("blend", "sink_aware", 0.3).blend_config(base)
    assert (cfg.recompute_ratio, cfg.selection, cfg.check_layer) == (0.3, "sink_aware", 2)
    with pytest.raises(ValueError):
        MethodSpec("full_prefill").blend_config(base)


def test_a_method_may_name_its_storage_codec():
    specs = parse_methods("full_reuse:int8,query_profiled+prefix@0.15:int4,cacheblend@0.15", [0.15])
    assert [s.name for s in specs] == ["full_reuse:int8", "query_profiled+prefix@0.15:int4", "cacheblend@0.15"]
    assert [s.storage for s in specs] == ["int8", "int4", None]
    with pytest.raises(ConfigError, match="storage 'int3' is not one of"):
        parse_methods("full_reuse:int3", [0.15])
    with pytest.raises(ConfigError, match="takes neither"):
        parse_methods("full_prefill:int8", [0.15])


def test_keyshift_sets_the_stale_key_correction_and_names_it_back():
    specs = parse_methods("cacheblend+keyshift@0.15,query_profiled+prefix+keyshift0.5@0.2,cacheblend@0.15", [0.3])
    assert [s.name for s in specs] == ["cacheblend+keyshift@0.15", "query_profiled+prefix+keyshift0.5@0.2",
                                       "cacheblend@0.15"]
    assert [s.blend_config(BlendConfig()).stale_key_correction for s in specs] == [1.0, 0.5, 0.0]
    assert specs[1].prefix_conditioned and specs[1].setting == "query_profiled+prefix+keyshift0.5@0.2"
    # The name a blend's stats give its setting parses back to the same setting.
    assert parse_methods(specs[0].setting, [0.3])[0].blend_config(BlendConfig()) == specs[0].blend_config(BlendConfig())


@pytest.mark.parametrize("text, message", [
    ("full_reuse+keyshift", "recomputes no chunk token"),
    ("default+keyshift", "recomputes no chunk token"),
    ("cacheblend+keyshift9@0.15", r"share in \[0, 2\]"),
    ("cacheblend+keyshiftx@0.15", r"share in \[0, 2\]"),
])
def test_a_bad_keyshift_says_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_methods(text, [0.15])


def test_probeshift_sets_probes_and_both_corrections_and_names_them_back():
    specs = parse_methods("cacheblend+probeshift@0.15,query_profiled+prefix+probeshift10@0.2", [0.3])
    assert [s.name for s in specs] == ["cacheblend+probeshift@0.15", "query_profiled+prefix+probeshift10@0.2"]
    configs = [s.blend_config(BlendConfig()) for s in specs]
    assert [(c.shift_probe_stride, c.stale_key_correction, c.stale_value_correction, c.shift_window)
            for c in configs] == [(20, 1.0, 1.0, 100), (10, 1.0, 1.0, 100)]
    assert specs[1].setting == "query_profiled+prefix+probeshift10@0.2"
    assert parse_methods(specs[0].setting, [0.3])[0].blend_config(BlendConfig()) == configs[0]
    whole_chunk = BlendConfig(selection="kv_deviation", recompute_ratio=0.15, shift_probe_stride=20,
                              stale_key_correction=1.0, stale_value_correction=0.5)
    assert describe_config(whole_chunk) == "kv_deviation+probeshift(k1,v0.5,w0)@0.15"


@pytest.mark.parametrize("text, message", [
    ("full_reuse+probeshift", "recomputes no chunk token"),
    ("cacheblend+probeshift1@0.15", "probe stride of 2 or more"),
    ("cacheblend+probeshiftx@0.15", "probe stride of 2 or more"),
    ("cacheblend+keyshift+probeshift@0.15", "drop '\\+keyshift'"),
])
def test_a_bad_probeshift_says_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_methods(text, [0.15])
