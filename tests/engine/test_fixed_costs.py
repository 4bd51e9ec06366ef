"""A blend's fixed costs: host syncs that do not grow with the layers, fused projections and rotations
that equal the model's own, and a decoding cache handed over without a copy."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from cacheblend_rag import BlendConfig, CachedSegment, FreshSegment
from bench_support.host_syncs import count_host_syncs
from cacheblend_rag.engine.decoding_cache import decoding_cache
from cacheblend_rag.testing import tiny_engine

# The settings whose per-layer work differs: full reuse, CacheBlend as published, the built-in default (a
# profile pass), a gradual strategy that narrows over layers, and the shipped 1.5B setting's probes.
SETTINGS = {
    "full reuse": BlendConfig(recompute_ratio=0.0, min_blend_tokens=0),
    "CacheBlend": BlendConfig(recompute_ratio=0.15, selection="kv_deviation", min_blend_tokens=0),
    "default": BlendConfig(recompute_ratio=0.15, min_blend_tokens=0),
    "gradual": BlendConfig(recompute_ratio=0.15, selection="gradual", min_blend_tokens=0),
    "probes": BlendConfig(recompute_ratio=0.2, stale_key_correction=1.0, stale_value_correction=1.0,
                          shift_probe_stride=10, min_blend_tokens=0),
}


def _segments(engine):
    torch.manual_seed(0)
    chunks = [torch.randint(3, 250, (60,)).tolist() for _ in range(4)]
    return [FreshSegment([1, 5, 7]), *map(CachedSegment, engine.prefill_chunks(chunks)), FreshSegment([9, 11, 13, 2])]


def _syncs(layers: int, cfg: BlendConfig, arch: str = "llama"):
    engine = tiny_engine(arch, num_hidden_layers=layers)
    segments = _segments(engine)
    engine.blend(segments, config=cfg)  # the one-time correctness gate runs here, not in the count
    return count_host_syncs(lambda: engine.blend(segments, config=cfg))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_host_syncs_do_not_grow_with_the_layers(setting):
    cfg = SETTINGS[setting]
    # Four layers leave a gradual strategy room to narrow to its budget (it reads each narrowing back,
    # a fixed number of them: log2 of its expansion), so eight add nothing.
    shallow, deep = _syncs(4, cfg), _syncs(8, cfg)
    assert deep.count == shallow.count, (shallow.by_site(), deep.by_site())
    assert deep.count <= 4, deep.by_site()  # issue 58's bound


def test_the_counter_sees_what_syncs_and_nothing_else():
    t = torch.arange(6)
    syncs = count_host_syncs(lambda: (t.tolist(), int(t[1]), t[t > 2], torch.bincount(t), t + 1, t[1:3]))
    assert [name for name, _ in syncs.sites] == ["tolist", "__int__", "__getitem__", "bincount"]
    assert all("test_fixed_costs.py" in where for _, where in syncs.sites), syncs.sites


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_and_rotation_equal_the_models_own(arch, dtype):
    engine = tiny_engine(arch, dtype=dtype)
    a = engine.adapter
    hidden = torch.randn(1, 7, engine.model.config.hidden_size).to(dtype)
    q, k, v = a.qkv(1, hidden)
    attn = engine.model.model.layers[1].self_attn
    b = (1, 7, -1, a.head_dim)
    want_q, want_k = attn.q_proj(hidden).view(b), attn.k_proj(hidden).view(b)
    if arch == "qwen3":
        want_q, want_k = attn.q_norm(want_q), attn.k_norm(want_k)
    assert torch.equal(q, want_q.transpose(1, 2)) and torch.equal(k, want_k.transpose(1, 2))
    assert torch.equal(v, attn.v_proj(hidden).view(b).transpose(1, 2))
    cos, sin = a.rope_cos_sin(hidden, torch.arange(3, 10).unsqueeze(0))
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    want = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(a.apply_rope(q, cos, sin), want[0]) and torch.equal(a.apply_rope(k, cos, sin), want[1])
    norm = engine.model.model.layers[1].input_layernorm
    assert torch.equal(a.input_norm(1, hidden), norm(hidden))


def test_fused_projections_follow_weights_changed_in_place():
    engine = tiny_engine("llama")
    a, hidden = engine.adapter, torch.randn(1, 3, engine.model.config.hidden_size)
    before = a.qkv(0, hidden)[1].clone()
    with torch.no_grad():
        engine.model.model.layers[0].self_attn.k_proj.weight.mul_(2)
    assert torch.allclose(a.qkv(0, hidden)[1], 2 * before, atol=1e-6)


def test_the_decoding_cache_is_the_blends_tensors_as_a_first_update_leaves_them():
    engine = tiny_engine("llama")
    keys = [torch.randn(1, 2, 5, 16) for _ in range(engine.num_layers)]
    values = [torch.randn(1, 2, 5, 16) for _ in range(engine.num_layers)]
    cache = decoding_cache(engine.model.config, keys, values)
    reference = DynamicCache(config=engine.model.config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        reference.update(k, v, layer)
    for layer in range(engine.num_layers):
        got, want = cache.layers[layer], reference.layers[layer]
        assert got.keys is keys[layer] and got.values is values[layer]  # handed over, not copied
        assert sorted(vars(got)) == sorted(vars(want))
        assert all(torch.equal(getattr(got, name), getattr(want, name)) if isinstance(getattr(got, name), torch.Tensor)
                   else getattr(got, name) == getattr(want, name) for name in vars(want))


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("rows_per_group", [1, 4, 1024])
@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4, 5], [0, 1, 2, 7, 19, 30, 31], [31], [3, 8, 20, 31],
                                       list(range(10, 32)), list(range(20, 32))])
def test_partial_attention_equals_masked_attention_over_every_key(monkeypatch, window, rows_per_group, positions):
    """Groups without a mask (one row at the last key, rows 0..k causally, or every row from a short prefix's
    end on, causally behind zero rows) and with one give what a dense causal (and windowed) mask over all keys
    gives."""
    from cacheblend_rag.engine import attention

    engine = tiny_engine("mistral" if window else "llama", **({"sliding_window": window} if window else {}))
    a, n = engine.adapter, 32
    monkeypatch.setattr(attention, "rows_per_group", lambda device: rows_per_group)
    torch.manual_seed(1)
    q = torch.randn(1, a.num_heads, len(positions), a.head_dim)
    k, v = torch.randn(1, a.num_kv_heads, n, a.head_dim), torch.randn(1, a.num_kv_heads, n, a.head_dim)
    pos = torch.tensor(positions)
    got = attention.PartialAttention("exact")(a, 0, q, k, v, pos, positions)
    plan = attention.attention_groups(pos, positions, n, "exact", window, q.dtype)
    assert [g.lead for g in plan] == ([10] if positions == list(range(10, 32)) and not window else [0] * len(plan))
    key_pos = torch.arange(n)
    allowed = key_pos[None, :] <= pos[:, None]
    if window:
        allowed &= key_pos[None, :] > pos[:, None] - window
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=a.attention_scale(0),
                                                            enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_stale_corrections_estimate_from_the_selected_probes_only(monkeypatch):
    """Probes are sifted on the host from the choice's positions: a gradual strategy that narrows its choice
    leaves out the probes it dropped, as the device-side sift did."""
    from cacheblend_rag.engine.blend_run import BlendRun

    seen = []
    original = BlendRun._estimating_tokens

    def recording(self):
        pos, rows = original(self)
        seen.append((set(pos.tolist()), set(self.selected_positions)))
        return pos, rows

    monkeypatch.setattr(BlendRun, "_estimating_tokens", recording)
    engine = tiny_engine("llama", num_hidden_layers=6)
    cfg = BlendConfig(recompute_ratio=0.3, selection="gradual", stale_key_correction=1.0, shift_probe_stride=4,
                      min_blend_tokens=0)
    engine.blend(_segments(engine), config=cfg)
    assert seen and all(estimators <= selected for estimators, selected in seen)


@pytest.mark.parametrize("setting", ["default", "CacheBlend"])
def test_decoding_takes_over_the_blends_layers_without_a_copy(setting):
    """Generation asks the blend for room after the prompt; decoding then writes into the blend's own buffers
    (layers the blend computed for every token, before a check layer, are copied as before)."""
    from cacheblend_rag.engine.generate import start_decoding
    from cacheblend_rag.config import GenerationConfig

    engine = tiny_engine("llama")
    cfg = SETTINGS[setting]
    decoding = start_decoding(engine, _segments(engine), GenerationConfig(max_new_tokens=6, temperature=0), cfg, None)
    blended_keys = [layer.keys for layer in decoding.cache.layers]
    kv = decoding.kv
    taken = [kv.keys[layer].data_ptr() == blended_keys[layer].data_ptr() for layer in range(engine.num_layers)]
    first_merged = 0 if setting == "default" else 2  # CacheBlend computes layers 0-1 on every token
    assert all(taken[first_merged:]) and not any(taken[:first_merged])
    assert all(k.shape[2] == blended_keys[0].shape[2] + decoding.room for k in kv.keys)


def test_generation_is_the_same_with_the_blends_buffers_taken_over():
    engine = tiny_engine("qwen2")
    segments = _segments(engine)
    cfg = SETTINGS["probes"]
    with_room = engine.generate(segments, config=cfg, max_new_tokens=8, temperature=0).token_ids
    blended = engine.blend(segments, config=cfg)  # no room: decoding copies every layer, as before
    from cacheblend_rag.engine.decode import DecodingKV

    assert all(DecodingKV(blended.cache, 4).buffers[i].data_ptr() != blended.cache.layers[i].keys.data_ptr()
               for i in range(engine.num_layers))
    assert with_room == engine.generate(segments, config=cfg, max_new_tokens=8, temperature=0).token_ids
