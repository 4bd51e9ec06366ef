"""BlendConfig.segment_recompute_ratio: cached segments (spans after the chunks from the segment cache,
``ChunkKV.approximate``) get their own recompute budget, chosen among them, beside the chunks'."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.kv.segments import CachedSegment, FreshSegment
from cacheblend_rag.engine.selection import selection_budget
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import tiny_engine

CHUNKS = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
]
SPAN = "\nuser: Who won two Nobel prizes?\nassistant: Marie Curie, in physics and in chemistry.\n"
STRATEGIES = ["query_profiled", "kv_deviation", "gradual", "sink_aware", "query_aware", "profiled_deviation",
              "stale_impact"]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def prompt(engine):
    """Lead, two chunks, a cached segment (approximate K/V), the question; and the blendable spans."""
    chunks = engine.prefill_chunks([engine.tokenize(c) for c in CHUNKS])
    span = replace(engine.prefill_chunk(engine.tokenize(SPAN)), approximate=True)
    segments = [FreshSegment(engine.tokenize("Context:\n")), *map(CachedSegment, chunks), CachedSegment(span),
                FreshSegment(engine.tokenize("\nuser: Where did she work?\nassistant:"))]
    lead = len(segments[0].token_ids)
    n_chunks = sum(len(c) for c in chunks)
    chunk_pos = set(range(lead, lead + n_chunks))
    segment_pos = set(range(lead + n_chunks, lead + n_chunks + len(span)))
    return segments, chunk_pos, segment_pos


@pytest.mark.parametrize("selection", STRATEGIES)
def test_the_budget_is_the_chunks_share_among_chunks_plus_the_segments_share_among_segments(engine, selection):
    segments, chunk_pos, segment_pos = prompt(engine)
    cfg = BlendConfig(recompute_ratio=0.15, segment_recompute_ratio=0.5, selection=selection)
    stats = engine.blend(segments, config=cfg).stats
    chunk_budget, segment_budget = selection_budget(0.15, len(chunk_pos)), selection_budget(0.5, len(segment_pos))
    assert stats.recomputed_tokens == chunk_budget + segment_budget
    chosen = set(stats.selected_positions)
    assert len(chosen & chunk_pos) == chunk_budget and len(chosen & segment_pos) == segment_budget


def test_none_pools_segments_with_the_chunks_under_one_ratio(engine):
    segments, chunk_pos, segment_pos = prompt(engine)
    stats = engine.blend(segments, config=BlendConfig(recompute_ratio=0.15, segment_recompute_ratio=None)).stats
    assert stats.recomputed_tokens == selection_budget(0.15, len(chunk_pos) + len(segment_pos))


def test_ratio_one_stays_exact_and_ratio_zero_full_reuse_whatever_the_segment_ratio(engine):
    segments, chunk_pos, segment_pos = prompt(engine)
    exact = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, segment_recompute_ratio=0.2))
    assert exact.stats.recomputed_tokens == len(chunk_pos) + len(segment_pos)
    full = engine.full_prefill([t for s in segments for t in s.token_ids])
    torch.testing.assert_close(exact.logits, full.logits, atol=1e-5, rtol=1e-5)
    reuse = engine.blend(segments, config=BlendConfig(recompute_ratio=0.0, segment_recompute_ratio=0.9)).stats
    assert reuse.mode == "full_reuse" and reuse.recomputed_tokens == 0


def test_a_segment_ratio_of_one_recomputes_every_segment_token_and_no_segment_changes_nothing(engine):
    segments, chunk_pos, segment_pos = prompt(engine)
    stats = engine.blend(segments, config=BlendConfig(recompute_ratio=0.15, segment_recompute_ratio=1.0)).stats
    assert segment_pos <= set(stats.selected_positions)
    assert stats.recomputed_tokens == selection_budget(0.15, len(chunk_pos)) + len(segment_pos)
    plain = [s for s in segments if not (isinstance(s, CachedSegment) and s.chunk.approximate)]
    a = engine.blend(plain, config=BlendConfig(segment_recompute_ratio=0.9))
    b = engine.blend(plain, config=BlendConfig(segment_recompute_ratio=None))
    assert torch.equal(a.logits, b.logits) and a.stats.selected_positions == b.stats.selected_positions


@pytest.mark.parametrize("value, message", [(1.5, "segment_recompute_ratio=1.5"), (-0.1, "segment_recompute_ratio"),
                                            ("high", "segment_recompute_ratio")])
def test_the_segment_ratio_is_validated(value, message):
    with pytest.raises(ConfigError, match=message):
        BlendConfig(segment_recompute_ratio=value)


def test_the_integrations_expose_and_validate_it(engine):
    from llama_index.llms.cacheblend import CacheBlendLLM

    assert BlendConfig().segment_recompute_ratio == 0.35
    llm = CacheBlendLLM.from_engine(engine, segment_recompute_ratio=0.5)
    assert llm.blend_config.segment_recompute_ratio == 0.5
    with pytest.raises(ValueError, match="segment_recompute_ratio"):
        CacheBlendLLM.from_engine(engine, segment_recompute_ratio=2.0)


@pytest.mark.parametrize("selection", ["query_profiled", "kv_deviation"])
def test_probe_tokens_stay_inside_the_chunks_share_beside_a_cached_segment(engine, selection):
    # The setting shipped for the 1.5B model blends with probes; a chat's cached segments must keep their share.
    segments, chunk_pos, segment_pos = prompt(engine)
    probes = dict(shift_probe_stride=10, stale_key_correction=1.0, stale_value_correction=1.0, shift_window=100)
    cfg = BlendConfig(recompute_ratio=0.2, segment_recompute_ratio=0.35, selection=selection, **probes)
    chosen = set(engine.blend(segments, config=cfg).stats.selected_positions)
    assert len(chosen & chunk_pos) == selection_budget(0.2, len(chunk_pos))
    assert len(chosen & segment_pos) == selection_budget(0.35, len(segment_pos))
    exact = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, **probes))
    full = engine.full_prefill([t for s in segments for t in s.token_ids])
    torch.testing.assert_close(exact.logits, full.logits, atol=1e-5, rtol=1e-5)
