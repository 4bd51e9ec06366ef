"""``ChunkAffinityRouter.choose_replicas`` on fake replicas, without Ray started: a request's documents go to
their home, a spill over a pile-up sends one request elsewhere without moving the set's home, and a request
without documents gets two random replicas (Ray's default)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from cacheblend_rag.server.replicas.router import ChunkAffinityRouter  # noqa: E402
from cacheblend_rag.server.replicas.routing import document_digest  # noqa: E402

DOCUMENTS = [document_digest(f"passage {i}") for i in range(4)]


def replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={})


class QueuesGiven(ChunkAffinityRouter):
    replica_queue_len_cache = None  # Ray's property, read from its probes; the test's queues instead


def router(queues: dict) -> ChunkAffinityRouter:
    chosen = object.__new__(QueuesGiven)  # Ray's constructor wants a running controller
    chosen.replica_queue_len_cache = SimpleNamespace(get=lambda rid: queues.get(rid.unique_id))
    return chosen


def choose(chosen: ChunkAffinityRouter, replicas, documents=DOCUMENTS) -> list[list[str]]:
    pending = SimpleNamespace(kwargs={"documents": documents})
    ranks = asyncio.run(chosen.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_a_spill_sends_one_request_elsewhere_and_the_set_keeps_its_home():
    replicas = [replica("a"), replica("b")]
    queues: dict = {}
    chosen = router(queues)
    home = choose(chosen, replicas)[0][0]
    other = next(r for r in "ab" if r != home)
    queues.update({home: 9, other: 1})  # a pile-up at home: 9 >= 3 + 2 * 1
    assert choose(chosen, replicas)[0] == [other]
    queues.update({home: 2, other: 1})
    assert choose(chosen, replicas)[0] == [home]  # back home, not where the spill went


def test_a_request_without_documents_gets_two_random_replicas():
    replicas = [replica("a"), replica("b"), replica("c")]
    ranks = choose(router({}), replicas, documents=[])
    assert len(ranks) == 1 and len(ranks[0]) == 2 and set(ranks[0]) <= {"a", "b", "c"}
