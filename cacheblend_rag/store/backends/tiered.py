"""TieredKVStore: fast tiers in front of slow ones (memory, then disk, then Redis).

Reads go through the tiers in order and copy what a slower tier returns into the faster
ones (promotion on hit). Writes go through to every tier; the slowest tier, the one shared
or kept longest, decides which concurrent write of a chunk wins.

A tier that fails (a full disk, a server that went away) is skipped, with one warning when
it starts failing and none for each later failure, until it works again. Only when every
tier fails does an operation raise.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator, Sequence, TypeVar

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.backends.base import KVStore, StoreStats
from cacheblend_rag.store.errors import StoreError

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _promotable(value: Any) -> bool:
    # A slower tier may answer a CorruptEntryError for one chunk (a Redis key of another type, a value beyond the
    # bound): that goes to the reader, which deletes the entry in every tier; it is never copied into a faster one.
    return isinstance(value, (bytes, bytearray, memoryview))


class TieredKVStore(KVStore):
    """``TieredKVStore(memory, disk)``, or any number of tiers, fastest first."""

    def __init__(self, *tiers: KVStore) -> None:
        super().__init__()
        if len(tiers) < 2 or not all(isinstance(t, KVStore) for t in tiers):
            raise ConfigError("TieredKVStore needs at least two KVStore tiers, fastest first, e.g. (memory, disk)")
        self.tiers = list(tiers)
        self._failing: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------- tier health
    def _call(self, index: int, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """Run ``fn`` on tier ``index``; ``(False, None)`` if the tier failed (warned once)."""
        try:
            result = fn()
        except (StoreError, OSError) as exc:
            with self._lock:
                first = index not in self._failing
                self._failing.add(index)
            if first:
                logger.warning("KV store tier %s is failing, skipping it until it recovers: %s",
                               self.tiers[index].describe(), exc)
            return False, None
        if index in self._failing:
            with self._lock:
                self._failing.discard(index)
            logger.warning("KV store tier %s works again", self.tiers[index].describe())
        return True, result

    def _all(self, what: str, fn: Callable[[KVStore], Any]) -> list[tuple[bool, Any]]:
        results = [self._call(i, lambda t=tier: fn(t)) for i, tier in enumerate(self.tiers)]
        if not any(ok for ok, _ in results):
            raise StoreError(f"every tier of {self.describe()} failed to {what}")
        return results

    def _first(self, get: Callable[[KVStore], Any], promote: Callable[[KVStore, Any], None]) -> Any:
        answered = False
        for i, tier in enumerate(self.tiers):
            ok, value = self._call(i, lambda t=tier: get(t))
            answered |= ok
            if value is not None:
                if _promotable(value):
                    for j in range(i):
                        self._call(j, lambda t=self.tiers[j], v=value: promote(t, v))
                return value
        if not answered:
            raise StoreError(f"every tier of {self.describe()} failed to read")
        return None

    # ------------------------------------------------------------ layers
    def get_layer(self, key: str, write_id: str, layer: int) -> bytes | None:
        return self._first(lambda t: t.get_layer(key, write_id, layer),
                           lambda t, data: t.put_layer(key, write_id, layer, data))

    def get_layers(self, requests: Sequence[tuple[str, str, int]]) -> list[bytes | None]:
        """One batched read per tier (one round trip to Redis) for what the faster tiers lacked.

        A value no tier returned while some tier failed may sit in the failed tier, so that
        raises :class:`StoreError` (the loader recomputes) rather than report it missing
        (which the loader would take for damage and delete).
        """
        found = self._batched(requests, lambda t, asked: t.get_layers(asked),
                              lambda t, request, data: t.put_layer(*request, data))
        if found is None:
            error = StoreError(f"a tier of {self.describe()} that may hold the layers asked for is failing")
            error.warned = True  # _call warned when the tier started failing
            raise error
        return found

    def get_manifests(self, keys: Sequence[str]) -> list[bytes | None]:
        found = self._batched(keys, lambda t, asked: t.get_manifests(asked),
                              lambda t, key, data: t.add_manifest(key, data), unreadable_is_missing=True)
        assert found is not None
        return found

    def _batched(self, requests: Sequence[Any], get: Callable[[KVStore, list], list],
                 promote: Callable[[KVStore, Any, bytes], Any], *, unreadable_is_missing: bool = False
                 ) -> list[bytes | None] | None:
        """Values of ``requests``, each from the fastest tier holding it, promoted to the faster tiers."""
        results: list[bytes | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        answered, failed = False, False
        for i, tier in enumerate(self.tiers):
            if not todo:
                break
            ok, values = self._call(i, lambda t=tier, asked=[requests[j] for j in todo]: get(t, asked))
            answered |= ok
            if not ok:
                failed = True
                continue
            for j, value in zip(todo, values):
                if value is not None:
                    results[j] = value
                    for faster in range(i if _promotable(value) else 0):
                        self._call(faster, lambda t=self.tiers[faster], r=requests[j], v=value: promote(t, r, v))
            todo = [j for j, value in zip(todo, values) if value is None]
        if not answered and requests:
            raise StoreError(f"every tier of {self.describe()} failed to read")
        if todo and failed and not unreadable_is_missing:
            return None
        return results

    def put_layer(self, key: str, write_id: str, layer: int, data: bytes) -> None:
        self._all("write a layer", lambda t: t.put_layer(key, write_id, layer, data))

    def delete_layers(self, key: str, write_id: str, num_layers: int) -> None:
        self._all("delete layers", lambda t: t.delete_layers(key, write_id, num_layers))

    # --------------------------------------------------------- manifests
    def get_manifest(self, key: str) -> bytes | None:
        # A promoted manifest may reach a faster tier before its layers do; reads of those
        # layers then fall through to the slower tier and promote them in turn.
        return self._first(lambda t: t.get_manifest(key), lambda t, data: t.add_manifest(key, data))

    def add_manifest(self, key: str, data: bytes) -> bool:
        won: bool | None = None
        for i in reversed(range(len(self.tiers))):
            ok, added = self._call(i, lambda t=self.tiers[i]: t.add_manifest(key, data))
            if ok and won is None:
                won = bool(added)
            if won is False:
                break  # another writer's entry stands; the caller removes this write's layers
        if won is None:
            raise StoreError(f"every tier of {self.describe()} failed to write a manifest")
        return won

    def contains(self, key: str) -> bool:
        return any(value for ok, value in
                   (self._call(i, lambda t=t: t.contains(key)) for i, t in enumerate(self.tiers)) if ok)

    def delete(self, key: str) -> bool:
        return any(value for ok, value in self._all("delete a chunk", lambda t: t.delete(key)) if ok)

    def keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for i, tier in enumerate(self.tiers):
            ok, keys = self._call(i, lambda t=tier: list(t.keys()))
            for key in keys or ():
                if key not in seen:
                    seen.add(key)
                    yield key

    # ------------------------------------------------------------- admin
    @property
    def shared(self) -> bool:
        return any(tier.shared for tier in self.tiers)

    @property
    def durable(self) -> KVStore:
        """The slowest tier, whose counters and size stand for the whole store."""
        return self.tiers[-1]

    def bind_model(self, fingerprint: str, *, max_value_bytes: int | None = None) -> None:
        super().bind_model(fingerprint, max_value_bytes=max_value_bytes)
        for tier in self.tiers:
            tier.bind_model(fingerprint, max_value_bytes=max_value_bytes)

    def record(self, **counts: int) -> None:
        super().record(**counts)
        self._call(len(self.tiers) - 1, lambda: self.durable.record(**counts))

    def stats(self) -> StoreStats:
        tiers = []
        for i, tier in enumerate(self.tiers):
            ok, stats = self._call(i, tier.stats)
            tiers.append({"store": tier.describe(), **(stats.to_dict() if ok and stats else {"error": "unavailable"})})
        ok, durable = self._call(len(self.tiers) - 1, self.durable.stats)
        base = durable if ok and durable else StoreStats(**self.counters())
        base.details = {"tiers": tiers}
        return base

    def clear(self) -> None:
        self._all("clear", lambda t: t.clear())
        self.reset_counters()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def describe(self) -> str:
        return "TieredKVStore(" + ", ".join(t.describe() for t in self.tiers) + ")"

    @staticmethod
    def of(tiers: Sequence[KVStore]) -> "TieredKVStore":
        return TieredKVStore(*tiers)
