"""RedisKVStore: chunk KV in a Redis server shared by every serving replica.

Layout. One Redis hash per chunk holds the chunk's manifest (field ``m``) and its layer
values (fields ``<write_id>:<layer>``), under the key::

    <prefix>:<namespace>:{<chunk key>}

``prefix`` is chosen by the user (one Redis for several applications); ``namespace`` is a
short digest of the model fingerprint, bound by :class:`~cacheblend_rag.store.ChunkCache`
(or given explicitly), so ``cache stats``/``clear`` can address one model. The braces are a
Redis Cluster hash tag: a chunk's fields never span slots. One hash per chunk also means
that the server's ``maxmemory`` eviction removes whole chunks, never single layers.

Visibility. Layers are written first, while the hash carries a short "pending" expiry, so
the layers of a writer that dies midway disappear by themselves. The manifest is written
last by a server-side script that checks every layer of the write is there, sets the
manifest only if none exists (the first complete write wins), and then replaces the pending
expiry by the configured ``ttl`` (or none). Readers only read chunks that have a manifest.

Reads of layer ``l`` of all chunks of a blend go out as one pipeline (two round trips: sizes, then
values, below), which the loader issues for layer ``l + 1`` while layer ``l`` computes.

Values are the checksummed byte format of :mod:`cacheblend_rag.store.format.chunk_bytes`; nothing is
ever unpickled (``decode_responses`` is off and values are handed on as raw bytes). Every read asks
for the values' sizes first (one more pipelined round trip) and reads only those no larger than any
value of its kind (a layer: the bound model's longest chunk at 32 bits; a manifest: its JSON bound):
an oversized value (planted, say) is never sent, so it cannot outlast the read timeout and open the
breaker; it is a corrupt entry (deleted, counted, recomputed).

Failures. A lost connection, a timeout, or a server that is restarting or loading raise
:class:`StoreError`, which the chunk cache and the tiered store treat as a miss. Reads wait at
most ``read_timeout`` (a request's deadline for the store: well under a second, where a healthy
loopback read takes milliseconds), writes and admin commands ``socket_timeout``; redis-py retries
a dropped connection once but never a timeout, so a hung server (``SIGSTOP``) costs one wait, not
two. The first failure opens a circuit breaker: no call touches the network again, so every
following request computes fresh at once, until a background probe (a ``PING`` every
``probe_interval`` seconds) finds the server answering and closes it. A request therefore waits
for a dead or hung store at most once, and hits resume within one probe interval of its return.
Bad URLs and rejected credentials are configuration errors, raised at construction with what to fix.

The connection and its breaker are in :mod:`~cacheblend_rag.store.backends.redis_connection`, the hash's fields
and the server-side scripts in :mod:`~cacheblend_rag.store.backends.redis_layout`; this module holds the store's
commands, its shared counters and its registration under ``redis://`` and ``rediss://``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import redis

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.backends.base import COUNTERS, KVStore, StoreStats
from cacheblend_rag.store.errors import StoreError
from cacheblend_rag.store.format.chunk_bytes import MAX_MANIFEST_BYTES, peek_manifest
from cacheblend_rag.store.backends.redis_connection import RedisConnection, positive_seconds, redact_url
from cacheblend_rag.store.backends.redis_layout import (
    ADD_MANIFEST_SCRIPT,
    DELETE_SCRIPT,
    MANIFEST_FIELD,
    PUT_LAYER_SCRIPT,
    RECORD_SCRIPT,
    RESTORE_SCRIPT,
    bounded_hgets,
    corrupt_if_wrong_type,
    layer_field,
    model_namespace,
)
from cacheblend_rag.store.schemes import register_store_scheme

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "cacheblend"
# Namespace of a store not bound to a model: stats/clear/keys then cover every namespace.
_ANY_NAMESPACE = "*"
_SCAN_BATCH = 500


class RedisKVStore(RedisConnection, KVStore):
    """Chunk KV in Redis at ``url`` (``redis://[[user]:password@]host[:port][/db]``, or ``rediss://`` for TLS).

    ``prefix`` starts every key; ``namespace`` separates models (default: bound to the model
    by the chunk cache). ``ttl`` (seconds) expires entries that long after they were written;
    without it, entries stay until deleted or evicted by the server's ``maxmemory-policy``.
    ``read_timeout`` bounds each read (then the request computes fresh), ``socket_timeout`` each write
    or admin command; while the server is unavailable a background probe tries it every
    ``probe_interval`` seconds (``max_backoff`` is its former name). ``check_connection=False``
    starts without reaching the
    server (a replica may start while Redis is down; calls fail over until it is up).

    ``cluster=True`` talks to a Redis Cluster through any of its nodes (a cluster client must
    reach a node at construction).

    The URL may carry ``prefix``, ``namespace``, ``ttl`` and ``cluster`` as query parameters,
    next to redis-py's own (``socket_timeout``, ``ssl_cert_reqs``, ...), e.g.
    ``redis://:secret@cache:6379/0?prefix=myapp&ttl=86400``.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str | None = None,
        namespace: str | None = None,
        ttl: float | None = None,
        pending_ttl: float = 3600,
        socket_timeout: float = 2.0,
        read_timeout: float = 0.5,
        connect_timeout: float = 1.0,
        probe_interval: float = 1.0,
        max_backoff: float | None = None,
        check_connection: bool = True,
        cluster: bool = False,
    ) -> None:
        super().__init__()
        url, options = self._split_url(url)
        prefix = options.pop("prefix", prefix) or DEFAULT_PREFIX
        namespace = options.pop("namespace", namespace)
        ttl = options.pop("ttl", ttl)
        cluster = options.pop("cluster", cluster)
        if isinstance(cluster, str):
            if cluster.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"cluster={cluster!r} must be true or false")
            cluster = cluster.lower() in ("true", "1", "yes")
        for name, value in (("prefix", prefix), ("namespace", namespace)):
            if value is not None and (not value or any(c in value for c in ":{}*?[] ")):
                raise ConfigError(f"{name}={value!r} must be a non-empty name without ':', braces, spaces "
                                  "or glob characters")
        self.url = url
        self.prefix = prefix
        self.namespace = namespace
        self.ttl = None if ttl in (None, "", "0", 0) else int(positive_seconds("ttl", ttl))
        self.pending_ttl = int(positive_seconds("pending_ttl", pending_ttl))
        self.probe_interval = positive_seconds(
            "probe_interval", options.pop("probe_interval", probe_interval if max_backoff is None else max_backoff))
        self.read_timeout = positive_seconds("read_timeout", options.pop("read_timeout", read_timeout))
        self.cluster = bool(cluster)
        self._open_clients(url, options, socket_timeout, connect_timeout)
        self._put_layer = self._client.register_script(PUT_LAYER_SCRIPT)
        self._add_manifest = self._client.register_script(ADD_MANIFEST_SCRIPT)
        self._delete = self._client.register_script(DELETE_SCRIPT)
        self._record = self._client.register_script(RECORD_SCRIPT)
        self._restore = self._client.register_script(RESTORE_SCRIPT)
        # The shared counters as this replica last saw them, and the epoch of the hash they were in.
        self._seen_totals: dict[str, int] = {}
        self._epoch: str | None = None
        if check_connection:
            self.ping()


    # ----------------------------------------------------------------- keys
    def bind_model(self, fingerprint: str, *, max_value_bytes: int | None = None) -> None:
        """Put this store's keys under ``fingerprint``'s namespace, unless one was set explicitly."""
        super().bind_model(fingerprint, max_value_bytes=max_value_bytes)
        if self.namespace is None:
            self.namespace = model_namespace(fingerprint)
        elif self.namespace != model_namespace(fingerprint):
            # Chunk keys embed the fingerprint, so another model's entries never collide;
            # they only share this namespace.
            logger.debug("RedisKVStore namespace %s is kept for a second model", self.namespace)

    def _scope(self) -> str:
        return f"{self.prefix}:{self.namespace or _ANY_NAMESPACE}:"

    def _hash(self, key: str) -> bytes:
        if self.namespace is None:
            raise StoreError("RedisKVStore has no namespace yet: pass namespace=... or use it through a ChunkCache, "
                             "which binds it to the model")
        return f"{self.prefix}:{self.namespace}:{{{key}}}".encode()

    def _counters_key(self) -> bytes:
        return self._scope().encode() + b"counters"

    # --------------------------------------------------------------- layers
    def get_layer(self, key: str, write_id: str, layer: int) -> bytes | None:
        return self.get_layers([(key, write_id, layer)])[0]

    def get_layers(self, requests: Sequence[tuple[str, str, int]]) -> list[bytes | None]:
        if not requests:
            return []
        names = [(self._hash(key), layer_field(write_id, layer)) for key, write_id, layer in requests]
        with self._io("read layers"):  # bound by the model's largest layer value (bind_model); None: read whole
            return bounded_hgets(self._reader, names, self.max_value_bytes, "layer value")

    def put_layer(self, key: str, write_id: str, layer: int, data: bytes) -> None:
        name = self._hash(key)
        with self._io("write a layer"):
            self._put_layer(keys=[name], args=[layer_field(write_id, layer), bytes(data), self.pending_ttl])

    def delete_layers(self, key: str, write_id: str, num_layers: int) -> None:
        if num_layers < 1:
            return
        name = self._hash(key)
        with self._io("delete layers"):
            self._client.hdel(name, *(layer_field(write_id, layer) for layer in range(num_layers)))

    # ------------------------------------------------------------ manifests
    def get_manifest(self, key: str) -> bytes | None:
        return self.get_manifests([key])[0]

    def get_manifests(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        names = [(self._hash(key), MANIFEST_FIELD) for key in keys]
        with self._io("read manifests"):
            return bounded_hgets(self._reader, names, MAX_MANIFEST_BYTES, "manifest")

    def add_manifest(self, key: str, data: bytes) -> bool:
        manifest = peek_manifest(data)  # the script needs its write id and layer count
        name = self._hash(key)
        with self._io("write a manifest"):
            result = self._add_manifest(
                keys=[name], args=[bytes(data), self.ttl or 0, manifest.write_id, manifest.num_layers])
        if result == -1:
            raise StoreError(f"Redis at {redact_url(self.url)} lost layers of chunk {key[:12]}... before its manifest "
                             "was written (evicted under maxmemory?); the chunk stays absent")
        return result == 1

    def contains(self, key: str) -> bool:
        name = self._hash(key)
        with self._io("look up a manifest"):
            try:
                return bool(self._reader.hexists(name, MANIFEST_FIELD))
            except redis.exceptions.ResponseError as exc:
                raise corrupt_if_wrong_type(exc) from None

    def delete(self, key: str) -> bool:
        name = self._hash(key)
        with self._io("delete a chunk"):
            return bool(self._delete(keys=[name]))

    def _chunk_hashes(self) -> Iterator[bytes]:
        """Names of the chunk hashes in scope (with or without a manifest)."""
        with self._io("list keys"):
            names = list(self._client.scan_iter(match=self._scope() + "{*}", count=_SCAN_BATCH, _type="hash"))
        return iter(names)

    def _per_chunk(
        self, what: str, queue: Callable[[Any, bytes], Any], width: int
    ) -> Iterator[tuple[bytes, list[Any]]]:
        """Each chunk hash with the answers to the ``width`` commands ``queue(pipe, name)`` adds,
        asked in pipelined batches of ``_SCAN_BATCH`` hashes."""
        names = list(self._chunk_hashes())
        for start in range(0, len(names), _SCAN_BATCH):
            batch = names[start : start + _SCAN_BATCH]
            with self._io(what):
                pipe = self._client.pipeline(transaction=False)
                for name in batch:
                    queue(pipe, name)
                answers = pipe.execute()
            for i, name in enumerate(batch):
                yield name, answers[i * width : (i + 1) * width]

    def keys(self) -> Iterator[str]:
        for name, (has_manifest,) in self._per_chunk(
            "list keys", lambda pipe, name: pipe.hexists(name, MANIFEST_FIELD), 1
        ):
            if has_manifest:
                yield name.decode().rsplit("{", 1)[1].rstrip("}")

    def manifests(self) -> Iterator[tuple[str, Any]]:
        """Every chunk's manifest in scope (every model's when no namespace is bound)."""
        names = list(self._chunk_hashes())
        for start in range(0, len(names), _SCAN_BATCH):
            batch = names[start : start + _SCAN_BATCH]
            with self._io("read manifests"):
                manifests = bounded_hgets(self._client, [(name, MANIFEST_FIELD) for name in batch],
                                          MAX_MANIFEST_BYTES, "manifest")
            for name, manifest in zip(batch, manifests):
                if manifest is not None:
                    yield name.decode().rsplit("{", 1)[1].rstrip("}"), manifest

    # ---------------------------------------------------------------- admin
    def record(self, **counts: int) -> None:
        unknown = set(counts) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}; known counters are {COUNTERS}")
        if self.namespace is None or not any(counts.values()):
            super().record(**counts)
            return
        fields = [(name, int(n)) for name, n in counts.items() if n]
        with self._io("update its counters"):
            epoch, *totals = self._record(keys=[self._counters_key()], args=[x for field in fields for x in field])
            epoch = epoch.decode() if isinstance(epoch, bytes) else str(epoch or "")
            if not epoch:
                # The hash was just created: the first count ever, or the server evicted it (under
                # allkeys-lru any key may go). Put back what this replica last saw; what others added
                # since it last looked is lost, nothing else is. A deliberate reset sets a new epoch.
                if self._restore_counters():
                    totals = [int(t) + self._seen_totals.get(name, 0) for (name, _), t in zip(fields, totals)]
                epoch = self._epoch or ""
            self._epoch = epoch
            for (name, _), total in zip(fields, totals):
                self._seen_totals[name] = int(total)

    def _restore_counters(self) -> bool:
        """Put back the totals this replica last saw, if the counters hash lost its epoch (it was evicted
        and, perhaps, created again by an increment); ``True`` if this call restored them."""
        lost = [x for name, seen in self._seen_totals.items() if seen for x in (name, seen)]
        self._epoch = self._epoch or os.urandom(8).hex()
        restored = bool(self._restore(keys=[self._counters_key()], args=[self._epoch, *lost]))
        if restored and lost:
            logger.info("the shared counters of %s were evicted; restored the totals this replica saw", self.describe())
        return restored and bool(lost)

    def _counter_hashes(self) -> list[bytes]:
        if self.namespace is not None:
            return [self._counters_key()]
        return list(self._client.scan_iter(match=self._counters_key(), count=_SCAN_BATCH))

    def counters(self) -> dict[str, int]:
        """Counts shared by every replica (summed over all models when no namespace is bound)."""
        totals = super().counters()
        with self._io("read its counters"):
            if self._epoch is not None and self.namespace is not None:
                # Evicted since this replica last counted: put back what it saw (best effort: a server
                # out of memory refuses the write, and the read goes on without it).
                with contextlib.suppress(redis.exceptions.ResponseError):
                    self._restore_counters()
            for name in self._counter_hashes():
                for field, value in self._client.hgetall(name).items():
                    if field.decode() in totals:
                        totals[field.decode()] += int(value)
        return totals

    def reset_counters(self) -> None:
        super().reset_counters()
        with self._io("reset its counters"):
            names = set(self._counter_hashes())
            if self.namespace is not None:
                names.add(self._counters_key())
            # Zeros under a new epoch: replicas take them as a reset, not as an eviction to undo.
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.unlink(name)
                pipe.hset(name, "epoch", os.urandom(8).hex())
            pipe.execute()
        self._seen_totals, self._epoch = {}, None

    def stats(self) -> StoreStats:
        """Entries, bytes, counters and the server's memory settings; never raises (a server that does not
        answer gives ``available=False``, with this replica's own counts)."""
        try:
            return self._server_stats()
        except StoreError as exc:
            details = {"url": redact_url(self.url), "prefix": self.prefix, "namespace": self.namespace}
            return StoreStats(**super().counters(), available=False, error=str(exc), details=details)

    def _server_stats(self) -> StoreStats:
        def queue(pipe: Any, name: bytes) -> None:
            pipe.hexists(name, MANIFEST_FIELD)
            pipe.memory_usage(name, samples=0)

        entries, used = 0, 0
        for _, (has_manifest, size) in self._per_chunk("measure its size", queue, 2):
            entries += bool(has_manifest)
            used += int(size or 0)
        with self._io("read its memory settings"):
            memory = self._client.info("memory")
        details = {"url": redact_url(self.url), "prefix": self.prefix, "namespace": self.namespace, "ttl": self.ttl,
                   "server_used_memory": memory.get("used_memory"), "server_maxmemory": memory.get("maxmemory"),
                   "server_maxmemory_policy": memory.get("maxmemory_policy")}
        return StoreStats(entries=entries, bytes=used, **self.counters(), details=details)

    def clear(self) -> None:
        names = list(self._chunk_hashes())
        with self._io("clear"):
            for start in range(0, len(names), _SCAN_BATCH):
                self._client.unlink(*names[start : start + _SCAN_BATCH])
        self.reset_counters()

    def close(self) -> None:
        self._closed.set()  # ends the probe
        for client in (self._client, self._reader):
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                client.close()

    def describe(self) -> str:
        namespace = "" if self.namespace is None else f", namespace={self.namespace}"
        ttl = "" if self.ttl is None else f", ttl={self.ttl}s"
        return f"RedisKVStore({redact_url(self.url)!r}, prefix={self.prefix}{namespace}{ttl})"


def _open_redis(spec: str, *, size_limit: int | None = None, **options: Any) -> RedisKVStore:
    if size_limit is not None:
        raise ConfigError("size_limit does not apply to a Redis store; bound it on the server with maxmemory "
                          "and maxmemory-policy allkeys-lru (whole chunks are evicted)")
    return RedisKVStore(spec, **options)


register_store_scheme("redis", _open_redis)
register_store_scheme("rediss", _open_redis)

__all__ = ["RedisKVStore", "model_namespace", "redact_url"]
