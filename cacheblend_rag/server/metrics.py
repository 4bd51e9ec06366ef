"""``GET /metrics``: Prometheus text from prometheus-client, on a registry of each app's own.

Two kinds of numbers. Those the server counts as requests pass (requests by route and status, latency and
time to first token, prompt tokens by where their K/V came from, chunk hits and misses, fallbacks to full
prefill, errors by code) are counters and histograms updated per request. Those the engine and store keep
(the scheduler's queue depth and running requests, the store's hits, misses and failures, the prefix and
segment caches' state and hits) are read when scraped (:class:`_LiveCollector`), so they never drift from
what ``cacheblend-rag cache stats`` and ``BlendService.stats()`` say; they are for the operator, and no
response's stats carry them (one user would see another's requests in them). Its own registry per app lets
a test process build several apps.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cacheblend_rag.server.state import ServerState
from cacheblend_rag.serving.chat_turn import TurnEnd

ROUTES = ("/v1/chat/completions", "/v1/documents/warm", "/v1/models", "/health", "/metrics")
# Seconds: a tiny model on a CPU answers in milliseconds, a 1.5B model's long RAG prompt in seconds.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def route_label(path: str) -> str:
    """The route a path is counted under: a known one, else ``other`` (no label per unknown path)."""
    return path if path in ROUTES else "other"


class ServerMetrics:
    """The metrics of one app and the registry they are exported from."""

    def __init__(self, state: ServerState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("cacheblend_http_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.latency = Histogram("cacheblend_request_latency_seconds", "Seconds from a request's arrival to the "
                                 "end of its response, by route", ["route"], buckets=_BUCKETS, registry=r)
        self.ttft = Histogram("cacheblend_time_to_first_token_seconds", "Seconds from a chat completion's arrival "
                              "to its first answer text (or its end, for an empty answer)", buckets=_BUCKETS,
                              registry=r)
        self.prompt_tokens = Counter("cacheblend_prompt_tokens", "Prompt tokens of finished chat completions by "
                                     "where their K/V came from: reused (from a cache, kept as is), recomputed "
                                     "(cached, recomputed by the blend), fresh (computed for the request)",
                                     ["origin"], registry=r)
        self.completion_tokens = Counter("cacheblend_completion_tokens", "Answer tokens of finished chat "
                                         "completions", registry=r)
        self.chunk_hits = Counter("cacheblend_chunk_hits", "Document chunks whose stored K/V a request used",
                                  registry=r)
        self.chunk_misses = Counter("cacheblend_chunk_misses", "Document chunks a request computed (and stored) "
                                    "for lack of a stored entry", registry=r)
        self.fallbacks = Counter("cacheblend_fallbacks", "Chat completions answered without blending chunk K/V "
                                 "(their stats carry a fallback_reason: no chunk found, reuse off, store down...)",
                                 registry=r)
        self.modes = Counter("cacheblend_completions_by_mode", "Finished chat completions by how their prompt was "
                             "computed (blend, full_prefill, prefix_cached, full_reuse)", ["mode"], registry=r)
        self.errors = Counter("cacheblend_errors", "Error responses and errors sent in a stream, by code",
                              ["code"], registry=r)
        self.warmed = Counter("cacheblend_warmed_documents", "Documents sent to /v1/documents/warm, by result",
                              ["result"], registry=r)
        r.register(_LiveCollector(state))

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        route = route_label(path)
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def observe_turn(self, end: TurnEnd, ttft_s: float) -> None:
        """A finished chat completion's tokens by origin, chunk hits and misses, and mode."""
        stats = end.stats
        self.ttft.observe(ttft_s)
        recomputed = int(stats.get("recomputed_tokens") or 0)
        reused = end.cached_tokens
        self.prompt_tokens.labels(origin="reused").inc(reused)
        self.prompt_tokens.labels(origin="recomputed").inc(recomputed)
        self.prompt_tokens.labels(origin="fresh").inc(max(0, end.prompt_tokens - reused - recomputed))
        self.completion_tokens.inc(end.completion_tokens)
        self.chunk_hits.inc(int(stats.get("cache_hits") or 0))
        self.chunk_misses.inc(int(stats.get("cache_misses") or 0))
        if stats.get("fallback_reason"):
            self.fallbacks.inc()
        self.modes.labels(mode=str(stats.get("mode") or "unknown")).inc()

    def observe_error(self, code: Any) -> None:
        self.errors.labels(code=str(code or "none")).inc()

    def render(self) -> bytes:
        """The exposition text (blocking: the store's stats may ask Redis)."""
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    """The scheduler's and the store's own counters, read at each scrape (nothing before the model is loaded)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def describe(self) -> list[Metric]:
        return []  # read live: described by what collect() yields

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("cacheblend_model_ready", "1 once the model is loaded and warmed up")
        ready.add_metric([], 1.0 if self.state.ready.is_set() else 0.0)
        yield ready
        settings = self.state.settings
        if settings is None:
            return
        yield from _scheduler_metrics(settings.service.scheduler.stats())
        yield from _store_metrics(settings.service.chunk_cache.stats())
        yield from _reuse_cache_metrics(settings.service)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    metric = GaugeMetricFamily(name, doc)
    metric.add_metric([], float(value))
    return metric


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    metric = CounterMetricFamily(name, doc)
    metric.add_metric([], float(value))
    return metric


def _scheduler_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    yield _gauge("cacheblend_queue_depth", "Requests waiting for the scheduler to start them", stats["queued"])
    yield _gauge("cacheblend_running_requests", "Requests the scheduler is blending or decoding", stats["running"])
    yield _gauge("cacheblend_kv_reserved_bytes", "KV memory the running requests reserved", stats["kv_reserved_bytes"])
    yield _gauge("cacheblend_kv_budget_bytes", "KV memory the running requests may hold together",
                 stats["kv_budget_bytes"])
    outcomes = CounterMetricFamily("cacheblend_scheduler_requests", "Requests the scheduler ended, by outcome",
                                   labels=["outcome"])
    for outcome in ("finished", "failed", "cancelled", "refused_queue_full", "refused_kv_budget"):
        outcomes.add_metric([outcome], float(stats[outcome]))
    yield outcomes
    yield _counter("cacheblend_decode_steps", "Batched decode steps the scheduler ran", stats["decode_steps"])


def _store_metrics(stats: Any) -> Iterator[Metric]:
    yield _gauge("cacheblend_store_available", "1 when the chunk store answered its last stats call",
                 1.0 if stats.available else 0.0)
    yield _gauge("cacheblend_store_entries", "Chunks in the store", stats.entries)
    yield _gauge("cacheblend_store_bytes", "Bytes the store holds", stats.bytes)
    yield _counter("cacheblend_store_hits", "Chunks whose stored K/V a blend used", stats.hits)
    yield _counter("cacheblend_store_misses", "Chunks a blend found no valid entry of", stats.misses)
    yield _counter("cacheblend_store_load_failures", "Chunks found but not read whole (the store failed), "
                   "recomputed", stats.load_failures)
    yield _counter("cacheblend_store_corrupt_entries", "Entries found damaged and deleted", stats.corrupt)
    yield _counter("cacheblend_store_foreign_key_entries", "Entries under another store key (or none): not used, "
                   "not deleted, their chunks computed fresh", stats.foreign_key_entries)
    yield _counter("cacheblend_store_writes_skipped", "Chunk writes skipped while the store took none",
                   stats.writes_skipped)
    yield _counter("cacheblend_store_write_backs_dropped", "Missed chunks not written back: the write-back queue "
                   "was full (a slow store)", stats.write_backs_dropped)
    yield _counter("cacheblend_store_evictions", "Chunks evicted to keep the store's bound", stats.evictions)



def _reuse_cache_metrics(service: Any) -> Iterator[Metric]:
    """The prefix cache's and segment cache's state and hits over all requests (nothing for one that is off)."""
    prefix, segment = service.prefix_cache, service.segment_cache
    if prefix is not None:
        held = prefix.stats()
        yield _gauge("cacheblend_prefix_cache_blocks", "Blocks the prefix cache holds", held.blocks)
        yield _gauge("cacheblend_prefix_cache_bytes", "Bytes the prefix cache holds", held.bytes)
        yield _counter("cacheblend_prefix_cache_hits", "Prefix-cache lookups that reused at least one block", held.hits)
        yield _counter("cacheblend_prefix_cache_misses", "Prefix-cache lookups that reused none", held.misses)
        yield _counter("cacheblend_prefix_cache_hit_tokens", "Prompt tokens the prefix cache served", held.hit_tokens)
        yield _counter("cacheblend_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                       held.queried_tokens)
        yield _counter("cacheblend_prefix_cache_evictions", "Blocks evicted to keep the prefix cache's bound",
                       held.evictions)
    if segment is not None:
        spans = segment.stats()
        yield _gauge("cacheblend_segment_cache_entries", "Spans the segment cache holds", spans.entries)
        yield _gauge("cacheblend_segment_cache_bytes", "Bytes the segment cache holds", spans.bytes)
        yield _counter("cacheblend_segment_cache_hits", "Spans the segment cache served", spans.hits)
        yield _counter("cacheblend_segment_cache_hit_tokens", "Tokens the segment cache served", spans.hit_tokens)


__all__ = ["ROUTES", "ServerMetrics", "route_label"]
