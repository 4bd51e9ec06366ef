"""Where each prompt token's K/V came from, read off a response's stats (LlamaIndex ``additional_kwargs``,
LangChain ``response_metadata["cacheblend"]``).

One "reused" share hides what matters: K/V from the chunk store is CacheBlend's reuse, K/V from the prefix
cache is an earlier prompt's opening (a repeated question is held there whole), and recomputed or fresh
tokens cost a prefill. The examples print these per question and as mean shares.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

# The origins, in the order they are printed; their counts add up to the prompt's tokens.
ORIGINS = ("chunk store", "prefix cache", "earlier spans", "chunks computed on a miss", "fresh")


def _count(stats: Mapping[str, Any], name: str) -> int:
    return int(stats.get(name) or 0)


def token_origins(stats: Mapping[str, Any]) -> dict[str, int]:
    """Prompt tokens by where their K/V came from: the chunk store, the prefix cache (an earlier prompt's
    opening), spans after the chunks an earlier request left (earlier spans), chunks computed for this
    request because the store lacked them, and fresh tokens (template, glue, question) computed here."""
    loaded, cached = _count(stats, "loaded_tokens"), _count(stats, "cached_tokens")
    prefix, spans = _count(stats, "prefix_tokens"), _count(stats, "segment_tokens")
    return dict(zip(ORIGINS, (max(0, loaded - prefix - spans), prefix, spans, max(0, cached - loaded),
                              _count(stats, "fresh_tokens"))))


def exact_prefix_tokens(stats: Mapping[str, Any]) -> int:
    """Of the prefix cache's tokens, those whose K/V is what full prefill computes (not an earlier blend's)."""
    return _count(stats, "prefix_tokens") - _count(stats, "approximate_prefix_tokens")


def origins_text(counts: Mapping[str, float], exact_prefix: float, unit: str = "") -> str:
    """``counts`` (of :func:`token_origins`, or shares of them) as one line, the prefix cache's exact part
    beside it; ``unit``: a format spec, ``"d"`` for counts, ``".0%"`` for shares."""
    return ", ".join(f"{name} {value:{unit}}" + (f" (exact {exact_prefix:{unit}})" if name == "prefix cache" else "")
                     for name, value in counts.items())


def mean_origin_shares(all_stats: Sequence[Mapping[str, Any]]) -> tuple[dict[str, float], float]:
    """The mean share of prompt tokens from each origin over several responses' stats, and the mean share
    from the prefix cache's exact part."""
    if not all_stats:
        raise ValueError("no stats to average: pass the stats of at least one response")
    n = len(all_stats)
    shares = {name: sum(token_origins(s)[name] / _count(s, "prompt_tokens") for s in all_stats) / n
              for name in ORIGINS}
    exact = sum(exact_prefix_tokens(s) / _count(s, "prompt_tokens") for s in all_stats) / n
    return shares, exact


__all__ = ["ORIGINS", "exact_prefix_tokens", "mean_origin_shares", "origins_text", "token_origins"]
