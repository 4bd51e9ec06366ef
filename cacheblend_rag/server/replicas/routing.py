"""Which replica a request goes to, by its documents: the policy of the chunk router, free of Ray.

A request's documents are known before it is tokenized: each is named by a digest of its text with its
whitespace normalized (:func:`document_digest`), the same on every front end, so every router in a
cluster agrees without talking to the others. For each replica the policy counts how many of the
request's documents it holds in its memory tier: what the replica last reported (its routing stats,
every few seconds) and where this router itself sent those documents lately (``placement_ttl_s``: long
enough for the answer and the next report; after it the report alone says, so a set the home has evicted
goes where it still is in memory, say where a spill left it). The replica holding most wins; among equals,
the one this router placed the set on last, then rendezvous hashing of the whole set (a set seen nowhere
yet), so a set has one home, a new replica takes over only the sets it now wins and a lost one hands over
only its own.

Homes are kept balanced (consistent hashing with bounded loads): a replica that took more than ``balance``
times its even share of this router's recent requests is passed over for the next replica in the set's
order, and the set moves there, where it stays (its latest placement wins ties), so hot sets spread over
the replicas by what they cost, not by their hashes' luck. A preferred replica whose queue reaches
``spill_threshold`` plus twice the shortest queue is passed over for the least loaded one, so a hot
document set cannot pin a replica while the others idle; a spill sends that one request elsewhere and
leaves the set's home where it was. What spills first is what the home would miss anyway: a request whose
documents the home reports holding in memory waits there until its queue reaches twice that bound. A
request without documents is left to Ray's default choice (power of two choices).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

# A preferred replica's queue spills a request over once it reaches this plus twice the shortest queue.
DEFAULT_SPILL_THRESHOLD = 3
# Documents whose placement a router remembers (each a 16-character digest and a replica id).
DEFAULT_REMEMBERED = 65536
# A home that took more than this times its even share of the recent requests takes no new set (bounded loads).
DEFAULT_BALANCE = 1.1
# Requests the recent load is counted over (an exponential decay of this window).
LOAD_WINDOW = 64
# Seconds a placement counts as held without the replica's report: a queued answer (seconds under load) and
# the next routing-stats report (every 2 s) fit well inside it.
DEFAULT_PLACEMENT_TTL_S = 30.0
# The paths whose body's "documents" route a request; every other request goes by Ray's default.
ROUTED_PATHS = frozenset({"/v1/chat/completions", "/v1/documents/warm"})


def document_digest(text: str) -> str:
    """A document's routing name: 16 hex digits of SHA-256 over its text with runs of whitespace made one
    space (a retriever that re-wraps a passage still sends it to the replica that holds it)."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()[:16]


def request_documents(path: str, body: bytes) -> list[str]:
    """The digests of the documents a request body brings (``documents``: strings or ``{"text": ...}``), in
    order; ``[]`` for another path or a body that is not such JSON (the replica answers its error)."""
    if path not in ROUTED_PATHS or not body:
        return []
    try:
        documents = json.loads(body).get("documents")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return []
    if not isinstance(documents, list):
        return []
    texts = [d if isinstance(d, str) else d.get("text") if isinstance(d, dict) else None for d in documents]
    return [document_digest(t) for t in texts if isinstance(t, str)]


def rendezvous_weight(replica_id: str, key: str) -> int:
    """Highest-random-weight hashing: each (replica, key) pair's weight, the same in every process."""
    return int.from_bytes(hashlib.blake2b(f"{replica_id}\0{key}".encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class ReplicaView:
    """What a router knows of one replica: its id, its queue (``None``: not probed lately) and the
    documents it last reported holding in its memory tier."""

    id: str
    queue: Optional[int] = None
    held: frozenset[str] = field(default_factory=frozenset)


class ChunkRouting:
    """The chunk router's choice (module docstring); one per router, not thread-safe (Ray calls a router
    on one event loop)."""

    def __init__(self, spill_threshold: int = DEFAULT_SPILL_THRESHOLD, remembered: int = DEFAULT_REMEMBERED,
                 placement_ttl_s: float = DEFAULT_PLACEMENT_TTL_S, balance: float = DEFAULT_BALANCE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(spill_threshold, bool) or not isinstance(spill_threshold, int) or spill_threshold < 1:
            raise ValueError(f"spill_threshold={spill_threshold!r} must be a positive number of requests")
        if isinstance(remembered, bool) or not isinstance(remembered, int) or remembered < 0:
            raise ValueError(f"remembered={remembered!r} must be a number of documents >= 0")
        if isinstance(placement_ttl_s, bool) or not isinstance(placement_ttl_s, (int, float)) or not placement_ttl_s > 0:
            raise ValueError(f"placement_ttl_s={placement_ttl_s!r} must be a number of seconds > 0")
        if isinstance(balance, bool) or not isinstance(balance, (int, float)) or not balance >= 1:
            raise ValueError(f"balance={balance!r} must be a number >= 1 (a replica's load over its even share)")
        self.spill_threshold = spill_threshold
        self.remembered = remembered
        self.placement_ttl_s = float(placement_ttl_s)
        self._clock = clock
        # document digest -> (replica id, when placed), oldest first
        self._placed: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.balance = float(balance)
        self._load: dict[str, float] = {}  # replica id -> requests routed to it lately (decayed)

    def rank(self, replicas: Sequence[ReplicaView], documents: Sequence[str]) -> list[list[str]]:
        """Replica ids in order of preference, as Ray's ranks: ``[[first], [the others, best first]]``;
        ``[]`` when there are no documents or no replicas (Ray's default choice then)."""
        return self._choose(replicas, documents)[0]

    def route(self, replicas: Sequence[ReplicaView], documents: Sequence[str]) -> list[list[str]]:
        """``rank``, remembering the documents as placed on the first choice when it is their home: a spill
        is not a move, the set keeps its home, where the next request goes once the queue is back."""
        ranks, home = self._choose(replicas, documents)
        if ranks and ranks[0][0] == home:
            self.placed(documents, home)
        if ranks:
            for rid in self._load:
                self._load[rid] *= 1 - 1 / LOAD_WINDOW
            self._load[ranks[0][0]] = self._load.get(ranks[0][0], 0.0) + 1
        return ranks

    def _choose(self, replicas: Sequence[ReplicaView], documents: Sequence[str]) -> tuple[list[list[str]], str]:
        if not documents or not replicas:
            return [], ""
        order = self._by_holding(replicas, documents)
        home = self._within_bound(order)
        first = home
        queues = [r.queue for r in replicas if r.queue is not None]
        # "Well above": the threshold over twice the shortest queue, so that under load (8 clients on 2
        # replicas keep ~4 queued each) a set stays home through the usual swings and moves only off a pile-up.
        # A home that holds the documents (its own report, not this router's placements, which outlive its
        # evictions) keeps them to twice that: spilling a request the home would miss costs no memory hit.
        if first.queue is not None and queues:
            bound = self.spill_threshold + 2 * min(queues)
            if _holds_most(first, documents):
                bound *= 2
            if first.queue >= bound:
                first = min((r for r in order if r.queue is not None), key=lambda r: r.queue or 0)
        return [[first.id], [r.id for r in order if r.id != first.id]], home.id

    def _within_bound(self, order: list[ReplicaView]) -> ReplicaView:
        """The first replica of the set's order whose recent load is within ``balance`` times an even share
        (bounded loads); the first outright until half a window is counted (the decayed count reaches
        ``LOAD_WINDOW / 2`` after ~44 requests): over fewer, a share says which sets came first, not load,
        and a set asked twice among a few (ten sets, each twice) would move off the replica it went to."""
        total = sum(self._load.get(r.id, 0.0) for r in order)
        if total < LOAD_WINDOW / 2:
            return order[0]
        cap = self.balance * total / len(order)
        return next((r for r in order if self._load.get(r.id, 0.0) <= cap), order[0])

    def home(self, replicas: Sequence[ReplicaView], documents: Sequence[str]) -> Optional[str]:
        """The replica holding most of the documents, load aside (neither the bound on homes nor a spill)."""
        return self._by_holding(replicas, documents)[0].id if documents and replicas else None

    def _by_holding(self, replicas: Sequence[ReplicaView], documents: Sequence[str]) -> list[ReplicaView]:
        wanted = set(documents)
        set_key = "\n".join(sorted(wanted))

        since = self._clock() - self.placement_ttl_s
        placed = {d: at[0] for d in wanted if (at := self._placed.get(d)) is not None and at[1] > since}

        def held(replica: ReplicaView) -> int:
            return sum(1 for d in wanted if d in replica.held or placed.get(d) == replica.id)

        def placed_here(replica: ReplicaView) -> int:  # a set moved by the bound stays where it moved
            return sum(1 for d in wanted if placed.get(d) == replica.id)

        return sorted(replicas, key=lambda r: (-held(r), -placed_here(r), -rendezvous_weight(r.id, set_key)))

    def placed(self, documents: Sequence[str], replica_id: str) -> None:
        """Remember that ``documents`` went to ``replica_id`` (its memory tier will hold them): counted as held
        there for ``placement_ttl_s``, then only as long as its report says so."""
        if not self.remembered:
            return
        now = self._clock()
        for digest in documents:
            self._placed.pop(digest, None)
            self._placed[digest] = (replica_id, now)
        while len(self._placed) > self.remembered:
            self._placed.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """A replica left: what it held is gone with it."""
        for digest in [d for d, (r, _) in self._placed.items() if r == replica_id]:
            del self._placed[digest]
        self._load.pop(replica_id, None)


def _holds_most(replica: ReplicaView, documents: Sequence[str]) -> bool:
    """Whether the replica reports holding at least half of the documents in its memory tier."""
    wanted = set(documents)
    return 2 * sum(1 for d in wanted if d in replica.held) >= len(wanted)


def held_documents(routing_stats: Any) -> frozenset[str]:
    """The documents a replica's routing stats say it holds (``{"documents": [...]}``), safely."""
    documents = routing_stats.get("documents") if isinstance(routing_stats, dict) else None
    return frozenset(d for d in documents if isinstance(d, str)) if isinstance(documents, list) else frozenset()


__all__ = ["ChunkRouting", "DEFAULT_BALANCE", "DEFAULT_PLACEMENT_TTL_S", "DEFAULT_SPILL_THRESHOLD", "ROUTED_PATHS",
           "ReplicaView", "document_digest", "held_documents", "rendezvous_weight", "request_documents"]
