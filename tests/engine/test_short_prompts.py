"""Below ``min_blend_tokens`` cached tokens a blend is no faster than full prefill, so the engine
answers by full prefill, exactly, and says so in the stats."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig, CacheBlendEngine, CachedSegment, FreshSegment
from cacheblend_rag.engine.blend import DEFAULT_MIN_BLEND_TOKENS
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import tiny_engine


@pytest.fixture(scope="module")
def engine():
    tiny = tiny_engine("llama")
    return CacheBlendEngine(tiny.model, tiny.tokenizer)  # the engine's own default threshold


def _prompt(engine, cached_tokens: int):
    torch.manual_seed(0)
    chunks = [torch.randint(10, 400, (cached_tokens // 2,)).tolist() for _ in range(2)]
    head, tail = [1, 5, 7], [9, 11, 13, 15]
    segments = [FreshSegment(head), *map(CachedSegment, engine.prefill_chunks(chunks)), FreshSegment(tail)]
    return segments, head + chunks[0] + chunks[1] + tail


def test_a_short_prompt_is_answered_by_full_prefill_and_says_why(engine):
    segments, ids = _prompt(engine, 40)
    result = engine.blend(segments, config=BlendConfig(recompute_ratio=0.15))
    assert result.stats.mode == "full_prefill" and result.stats.reused_tokens == 0
    assert f"min_blend_tokens={DEFAULT_MIN_BLEND_TOKENS}" in result.stats.fallback_reason
    assert torch.allclose(result.logits, engine.full_prefill(ids).logits, atol=1e-5)


def test_zero_always_blends_and_a_long_enough_prompt_blends_by_default(engine):
    short, _ = _prompt(engine, 40)
    assert engine.blend(short, config=BlendConfig(min_blend_tokens=0)).stats.mode == "blend"
    long, _ = _prompt(engine, DEFAULT_MIN_BLEND_TOKENS)
    stats = engine.blend(long, config=BlendConfig(recompute_ratio=0.15)).stats
    assert stats.mode == "blend" and stats.fallback_reason is None and stats.reused_tokens > 0


def test_min_blend_tokens_is_validated():
    with pytest.raises(ConfigError, match="min_blend_tokens"):
        BlendConfig(min_blend_tokens=-1)
    tiny = tiny_engine("llama")
    with pytest.raises(ConfigError, match="min_blend_tokens"):
        CacheBlendEngine(tiny.model, tiny.tokenizer, min_blend_tokens=1.5)
