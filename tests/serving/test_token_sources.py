"""Where a prompt's tokens got their K/V, read off a response's stats: counts that add up to the prompt,
one line naming every origin, and mean shares."""

from __future__ import annotations

import pytest

from cacheblend_rag.serving.token_sources import (
    ORIGINS, exact_prefix_tokens, mean_origin_shares, origins_text, token_origins,
)

# 100 prompt tokens: 80 cached (70 loaded: 20 from the prefix cache, 8 of them approximate, 10 earlier spans,
# 40 from the store; 10 computed on a miss), 20 fresh.
STATS = {"prompt_tokens": 100, "cached_tokens": 80, "loaded_tokens": 70, "prefix_tokens": 20,
         "approximate_prefix_tokens": 8, "segment_tokens": 10, "fresh_tokens": 20}


def test_token_origins_add_up_to_the_prompt() -> None:
    origins = token_origins(STATS)
    assert origins == {"chunk store": 40, "prefix cache": 20, "earlier spans": 10, "chunks computed on a miss": 10,
                       "fresh": 20}
    assert sum(origins.values()) == STATS["prompt_tokens"] and tuple(origins) == ORIGINS
    assert exact_prefix_tokens(STATS) == 12
    # Full prefill's stats: every token fresh, the missing counts read as 0.
    assert token_origins({"prompt_tokens": 5, "fresh_tokens": 5})["fresh"] == 5


def test_origins_in_words_and_mean_shares() -> None:
    assert origins_text(token_origins(STATS), exact_prefix_tokens(STATS), "d") == (
        "chunk store 40, prefix cache 20 (exact 12), earlier spans 10, chunks computed on a miss 10, fresh 20")
    shares, exact = mean_origin_shares([STATS, {**STATS, "prefix_tokens": 0, "approximate_prefix_tokens": 0,
                                                "loaded_tokens": 50}])
    assert shares["chunk store"] == pytest.approx(0.4) and shares["prefix cache"] == pytest.approx(0.1)
    assert exact == pytest.approx(0.06)
    assert origins_text(shares, exact, ".0%").startswith("chunk store 40%, prefix cache 10% (exact 6%)")
    with pytest.raises(ValueError, match="at least one response"):
        mean_origin_shares([])
