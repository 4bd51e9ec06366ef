"""The connection of :class:`~cacheblend_rag.store.redis_store.RedisKVStore` to its server: the URL
and its options, the two clients (writes and reads, each with its own timeout, one Redis or a
Redis Cluster), and the circuit breaker every command goes through.

Kept apart from the store's commands so that what happens when the server is down, hung or
rejects the credentials (the "Failures" part of :mod:`cacheblend_rag.store.backends.redis_store`) reads in
one place.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.errors import StoreError
from cacheblend_rag.store.urls import STORE_PASSWORD_ENV, redact, redact_url

logger = logging.getLogger(__name__)

# Errors after which the server is presumed down (not reachable, timing out, restarting, loading).
_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterDownError,
                redis.exceptions.RedisClusterException, OSError)


def positive_seconds(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        hint = ", or None for none" if allow_none else ""
        raise ConfigError(f"{name}={value!r} must be a positive number of seconds{hint}")
    return float(value)


class RedisConnection:
    """The clients of a Redis store and the breaker around them; a base of
    :class:`~cacheblend_rag.store.redis_store.RedisKVStore`, which sets these attributes before
    :meth:`_open_clients`."""

    url: str
    cluster: bool
    read_timeout: float
    probe_interval: float

    def _open_clients(self, url: str, options: dict[str, str], socket_timeout: float, connect_timeout: float) -> None:
        """``_client`` (writes and admin commands, waiting at most ``socket_timeout``) and ``_reader`` (reads,
        waiting at most ``read_timeout``) at ``url`` with redis-py's ``options``; the breaker starts closed."""
        client_class = redis.RedisCluster if self.cluster else redis.Redis
        self._client = self._reader = None
        try:
            full_url = url + (("?" + urlencode(options)) if options else "")
            connect_timeout = positive_seconds("connect_timeout", connect_timeout)
            timeout = options.get("socket_timeout", socket_timeout)
            self._client = self._make_client(client_class, full_url, positive_seconds("socket_timeout", timeout),
                                             connect_timeout)
            self._reader = self._make_client(client_class, url, self.read_timeout, min(connect_timeout,
                                                                                         self.read_timeout),
                                             {k: v for k, v in options.items() if k != "socket_timeout"})
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            # A cluster client reaches its nodes at construction already.
            self._client = None
            self._raise_connect_error(exc)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"Redis URL {redact_url(url)!r} is not valid: {redact(exc)}. Write "
                "redis://[[user]:password@]host[:port][/db] or rediss://... for TLS"
            ) from None
        self._health_lock = threading.Lock()
        self._down: str | None = None  # why the breaker is open, while it is
        self._probe: threading.Thread | None = None
        self._closed = threading.Event()

    @staticmethod
    def _make_client(client_class: type, url: str, timeout: float, connect_timeout: float,
                     options: dict[str, str] | None = None) -> Any:
        """A client whose commands wait at most ``timeout``. redis-py retries once a connection that
        dropped (a pooled one, say, after a server restart), never a timeout: a hung server costs
        one wait. Waiting for the server to come back is the probe's work, not a request's."""
        if options:
            url += "?" + urlencode(options)
        return client_class.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            decode_responses=False,
        )

    @staticmethod
    def _split_url(url: str) -> tuple[str, dict[str, str]]:
        """``url`` without its query, and the query's parameters."""
        try:
            parts = urlsplit(str(url))
        except ValueError as exc:
            raise ConfigError(f"Redis URL {redact_url(str(url))!r} is not valid: {redact(exc)}") from None
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigError(f"Redis URL {redact_url(str(url))!r} must start with redis:// or rediss:// (TLS)")
        if not parts.hostname:
            raise ConfigError(f"Redis URL {redact_url(str(url))!r} names no host; write redis://host:6379/0")
        try:
            port = parts.port
        except ValueError:
            port = 0
        if port == 0:
            raise ConfigError(f"Redis URL {redact_url(str(url))!r} has a port that is not a number in 1-65535")
        database = parts.path.strip("/")
        if database and not database.isdigit():
            raise ConfigError(f"Redis URL {redact_url(str(url))!r} names database {database!r}; a Redis database is "
                              "a number, e.g. redis://host:6379/0")
        options = dict(parse_qsl(parts.query))
        return urlunsplit(parts._replace(query="")), options

    # ---------------------------------------------------------- connection
    def ping(self) -> None:
        """Reach the server now; raises :class:`ConfigError` for rejected credentials, else :class:`StoreError`."""
        try:
            self._client.ping()
        except (TypeError, redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            self._raise_connect_error(exc)
        self._mark_up()

    def _raise_connect_error(self, exc: BaseException) -> None:
        where = redact_url(self.url)
        message = redact(exc)  # redis-py's message: whatever it says, never a password
        if isinstance(exc, TypeError):  # redis-py passes unknown URL query parameters on to the connection
            raise ConfigError(f"Redis URL {where!r} has an option redis-py does not know ({message}); this store "
                              "adds prefix, namespace, ttl and cluster to redis-py's own (socket_timeout, "
                              "ssl_cert_reqs, ...)") from None
        auth_failed = isinstance(exc, (redis.exceptions.AuthenticationError,
                                       redis.exceptions.AuthenticationWrongNumberOfArgsError))
        if auth_failed or any(word in message.lower() for word in ("noauth", "wrongpass", "invalid password",
                                                                    "invalid username-password", "authenticat")):
            if urlsplit(self.url).password is None:
                raise ConfigError(f"Redis at {where} requires a password ({message}); write "
                                  "redis://:PASSWORD@host:port/0 (or redis://USER:PASSWORD@... for an ACL user), "
                                  f"or set ${STORE_PASSWORD_ENV}") from None
            raise ConfigError(f"Redis at {where} rejected the credentials ({message}). Put the right password in the "
                              "URL (redis://:PASSWORD@host:port/0, or redis://USER:PASSWORD@... for an ACL user), "
                              f"store_password= or ${STORE_PASSWORD_ENV}") from None
        if isinstance(exc, redis.exceptions.ResponseError):
            raise StoreError(f"Redis at {where} answered PING with an error: {message}") from None
        raise StoreError(f"cannot reach Redis at {where}: {message}. Check the host and port, that the server "
                         "runs, and that TLS (rediss://) matches the server; or pass check_connection=False "
                         "to start while it is down") from None

    def _mark_up(self) -> None:
        if self._down is not None:
            with self._health_lock:
                was_down, self._down = self._down, None
            if was_down:
                logger.warning("Redis at %s answers again; reading and writing it again", redact_url(self.url))

    def _trip(self, why: str) -> bool:
        """Open the breaker and start the probe; ``True`` if it was closed (the first failure)."""
        with self._health_lock:
            first, self._down = self._down is None, why
            if self._probe is None or not self._probe.is_alive():
                self._probe = threading.Thread(target=self._probe_until_up, name="cacheblend-redis-probe",
                                               daemon=True)
                self._probe.start()
        return first

    def _probe_until_up(self) -> None:
        """PING every ``probe_interval`` seconds (waiting at most ``read_timeout``) until the server answers."""
        while not self._closed.wait(self.probe_interval):
            try:
                self._reader.ping()
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
                logger.debug("Redis at %s still does not answer: %s", redact_url(self.url), redact(exc))
                continue
            self._mark_up()
            return

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        where = redact_url(self.url)
        if self._down is not None:
            error = StoreError(f"Redis at {where} is unavailable ({self._down}); cannot {what}, a probe checks it "
                               f"every {self.probe_interval:g}s")
            error.warned = True  # said when it went down
            raise error
        try:
            yield
        except StoreError:
            raise
        except _UNAVAILABLE as exc:
            first = self._trip(f"{type(exc).__name__}: {redact(exc)}")
            error = StoreError(f"Redis at {where} is unavailable ({redact(exc)}); cannot {what}, skipping it until "
                               f"a probe (every {self.probe_interval:g}s) finds it answering")
            error.warned = not first
            raise error from exc
        except redis.exceptions.RedisError as exc:
            message = str(exc)
            if "LOADING" in message or "MASTERDOWN" in message or "TRYAGAIN" in message:
                self._trip(message)
            raise StoreError(f"Redis at {where} cannot {what}: {redact(exc)}") from exc
