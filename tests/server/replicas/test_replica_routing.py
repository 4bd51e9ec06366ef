"""The chunk router's policy (``cacheblend_rag.server.replicas.routing``), without Ray: document digests, the
documents of a request body, rendezvous homes (order-free, fair, moving only what a change of replicas must),
held documents over rendezvous, remembered placements, and the load spill."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from cacheblend_rag.server.replicas.routing import (ChunkRouting, ReplicaView, document_digest, held_documents,
                                                    rendezvous_weight, request_documents)

REPLICAS = ["replica-a", "replica-b", "replica-c"]


def views(ids) -> list[ReplicaView]:
    return [ReplicaView(id=i) for i in ids]


def home(ids, documents, routing=None) -> str:
    """The first choice for ``documents`` among replicas ``ids`` that hold nothing and report no queue."""
    return (routing or ChunkRouting()).rank(views(ids), documents)[0][0]


def random_sets(n: int = 200, seed: int = 7) -> list[list[str]]:
    rng = random.Random(seed)
    return [[document_digest(f"doc {rng.getrandbits(64)}") for _ in range(rng.randint(1, 5))] for _ in range(n)]


def a_set_whose_home_is_not(replica: str, ids=REPLICAS) -> list[str]:
    return next(s for s in random_sets() if home(ids, s) != replica)


# --------------------------------------------------------------------------- digests and request bodies
def test_a_digest_is_stable_and_ignores_how_the_text_is_wrapped():
    text = "The river delta is described here."
    assert document_digest(text) == hashlib.sha256(text.encode()).hexdigest()[:16]  # the same in every process
    assert len(document_digest(text)) == 16
    rewrapped = "  The river\ndelta   is\tdescribed\n\n here.  "
    assert document_digest(rewrapped) == document_digest(text)
    assert document_digest("The river delta is described there.") != document_digest(text)
    assert document_digest("Theriver delta is described here.") != document_digest(text)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/documents/warm"])
def test_the_documents_of_a_routed_body_in_order(path):
    body = {"messages": [{"role": "user", "content": "hi"}],
            "documents": ["first  passage", {"title": "t", "text": "second passage"}, {"title": "no text"},
                          {"text": 5}, 7, None, "third passage"]}
    assert request_documents(path, json.dumps(body).encode()) == [
        document_digest("first passage"), document_digest("second passage"), document_digest("third passage")]


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/v1/chat/completions/", "/v1/documents"])
def test_other_paths_route_by_nothing(path):
    assert request_documents(path, json.dumps({"documents": ["a passage"]}).encode()) == []


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b"\xff\xfe\x00garbage", b"null", b"[1, 2]", b'"documents"',
                                  b"3", b'{"documents": "a passage"}', b'{"documents": {"text": "a"}}',
                                  b'{"documents": null}', b'{"messages": []}', b'{"documents": []}'])
def test_a_body_without_a_list_of_documents_routes_by_nothing(body):
    assert request_documents("/v1/chat/completions", body) == []


# --------------------------------------------------------------------------- rendezvous homes
def test_a_set_has_one_home_whatever_the_order_of_replicas_and_documents():
    routing = ChunkRouting()
    rng = random.Random(3)
    for documents in random_sets(50):
        first = home(REPLICAS, documents, routing)
        for _ in range(3):
            ids, docs = REPLICAS[:], documents[:]
            rng.shuffle(ids)
            rng.shuffle(docs)
            assert home(ids, docs, routing) == first
        assert home(REPLICAS, documents + documents[:1], routing) == first  # a repeated document: the same set


def test_rendezvous_weights_are_deterministic_and_differ_by_replica():
    assert rendezvous_weight("r1", "k") == rendezvous_weight("r1", "k")
    assert rendezvous_weight("r1", "k") != rendezvous_weight("r2", "k")
    assert rendezvous_weight("r1", "k") == int.from_bytes(hashlib.blake2b(b"r1\0k", digest_size=8).digest(), "big")


def test_each_replica_gets_a_fair_share_of_the_sets():
    sets = random_sets()
    homes = [home(REPLICAS, s) for s in sets]
    for replica in REPLICAS:
        assert 0.20 <= homes.count(replica) / len(sets) <= 0.47, {r: homes.count(r) for r in REPLICAS}


def test_a_new_replica_takes_only_the_sets_it_now_wins():
    sets = random_sets()
    before = [home(REPLICAS, s) for s in sets]
    after = [home([*REPLICAS, "replica-d"], s) for s in sets]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == "replica-d" for _, a in moved), "a set moved between the old replicas"
    assert 0.12 <= len(moved) / len(sets) <= 0.40, len(moved)


def test_a_lost_replica_hands_over_only_its_own_sets():
    sets = random_sets()
    before = [home(REPLICAS, s) for s in sets]
    after = [home(["replica-a", "replica-c"], s) for s in sets]
    for b, a in zip(before, after):
        assert a == b if b != "replica-b" else a in ("replica-a", "replica-c")
    assert "replica-b" in before  # the test means something


# --------------------------------------------------------------------------- held documents, placements
def test_held_documents_beat_rendezvous():
    documents = [document_digest(f"held {i}") for i in range(3)]
    rendezvous_last = ChunkRouting().rank(views(REPLICAS), documents)[1][-1]
    for holder in REPLICAS:  # whichever replica holds 2 of the 3 documents wins, even rendezvous' last
        replicas = [ReplicaView(id=r, held=frozenset(documents[:2]) if r == holder else frozenset())
                    for r in REPLICAS]
        assert ChunkRouting().rank(replicas, documents)[0] == [holder]
    # 2 of 3 beat 1 of 3
    other = next(r for r in REPLICAS if r != rendezvous_last)
    replicas = [ReplicaView(id=rendezvous_last, held=frozenset(documents[1:])),
                ReplicaView(id=other, held=frozenset(documents[:1])),
                *[ReplicaView(id=r) for r in REPLICAS if r not in (rendezvous_last, other)]]
    ranks = ChunkRouting().rank(replicas, documents)
    assert ranks[0] == [rendezvous_last] and ranks[1][0] == other


def test_held_documents_outside_the_request_do_not_count():
    documents = [document_digest("asked")]
    target = next(r for r in REPLICAS if r != home(REPLICAS, documents))
    replicas = [ReplicaView(id=r, held=frozenset({document_digest(f"other {i}") for i in range(9)})
                            if r == target else frozenset()) for r in REPLICAS]
    assert ChunkRouting().rank(replicas, documents)[0] == [home(REPLICAS, documents)]


def test_placements_count_as_held_until_the_replica_is_forgotten():
    routing = ChunkRouting()
    documents = a_set_whose_home_is_not("replica-b")
    routing.placed(documents, "replica-b")
    assert routing.rank(views(REPLICAS), documents)[0] == ["replica-b"]
    assert routing.rank(views(REPLICAS), documents[:1])[0] == ["replica-b"]  # a part of the set too
    routing.placed(documents[:1], "replica-c")  # placed again elsewhere: the latest placement counts
    if len(documents) > 2:
        assert routing.rank(views(REPLICAS), documents)[0] == ["replica-b"]
    assert routing.rank(views(REPLICAS), documents[:1])[0] == ["replica-c"]
    routing.forget("replica-b")
    routing.forget("replica-c")
    assert routing.rank(views(REPLICAS), documents)[0] == [home(REPLICAS, documents)]


def test_a_placement_counts_for_its_ttl_then_the_reports_say_where_the_set_is():
    """A set placed on its home, then spilled to another replica that reports holding it: while the placement
    is fresh the tie goes to rendezvous (the home); once it is stale, the home's report (it evicted the set)
    and the other's (it holds it) send the set where it is still in memory."""
    now = [100.0]
    routing = ChunkRouting(placement_ttl_s=30, clock=lambda: now[0])
    documents = random_sets(1)[0]
    preferred = home(REPLICAS, documents)
    holder = next(r for r in REPLICAS if r != preferred)
    routing.placed(documents, preferred)
    replicas = [ReplicaView(r, held=frozenset(documents) if r == holder else frozenset()) for r in REPLICAS]
    assert routing.rank(replicas, documents)[0] == [preferred]
    now[0] += 29
    assert routing.rank(replicas, documents)[0] == [preferred]
    now[0] += 2
    assert routing.rank(replicas, documents)[0] == [holder]
    assert routing.rank(views(REPLICAS), documents)[0] == [preferred]  # held nowhere: rendezvous again
    routing.route(replicas, documents)  # routed to the holder: placed there, fresh
    assert routing.rank(views(REPLICAS), documents)[0] == [holder]


def test_homes_stay_within_the_bound_and_a_moved_set_stays_where_it_moved():
    """Bounded loads: sets whose hashes all favour one replica, asked in turn, end up spread over both (each
    within ``balance`` of an even share), and each set keeps to one replica once moved (no flip-flop)."""
    pair = REPLICAS[:2]
    sets = [s for s in random_sets(400) if home(pair, s) == pair[0]][:12]
    routing = ChunkRouting(balance=1.1)
    went: list[tuple[int, str]] = []
    for i in range(600):
        which = i % len(sets)
        went.append((which, routing.route(views(pair), sets[which])[0][0]))
    last = went[-240:]
    share = sum(r == pair[1] for _, r in last) / len(last)
    assert 0.4 <= share <= 0.6, share  # without the bound: 0.0, every set on its hash's replica
    # Once the loads settle each set keeps to one replica: at most a few move within the last 20 rounds.
    moved = sum(len({r for w, r in last if w == which}) > 1 for which in range(len(sets)))
    assert moved <= 2, moved
    assert ChunkRouting(balance=1.1).route(views(pair), sets[0])[0][0] == pair[0]  # a fresh router: its hash's home


def test_the_bound_waits_for_a_window_of_requests_and_forgets_a_lost_replica():
    pair = REPLICAS[:2]
    documents = next(s for s in random_sets() if home(pair, s) == pair[0])
    routing = ChunkRouting()
    assert all(routing.route(views(pair), documents)[0] == [pair[0]] for _ in range(40))  # too few to judge
    routing.forget(pair[0])
    assert pair[0] not in routing._load


def test_ten_sets_asked_twice_each_stay_where_they_went_first_whatever_their_hashes_split():
    """The issue's check (ten document sets, each repeated on the replica it went to first) holds however
    the sets' hashes split over two replicas: 20 requests are too few for the bound on homes to move one
    (a real app failed this at a 6/4 split when the bound judged from the 19th request on)."""
    pair = REPLICAS[:2]
    candidates = random_sets(400)
    for on_first in range(11):  # every split of ten sets: 0/10 ... 10/0
        sets = ([s for s in candidates if home(pair, s) == pair[0]][:on_first]
                + [s for s in candidates if home(pair, s) == pair[1]][:10 - on_first])
        routing, first = ChunkRouting(), {}
        for _ in range(2):
            for n, documents in enumerate(sets):
                went = routing.route(views(pair), documents)[0][0]
                assert first.setdefault(n, went) == went, (on_first, n)


@pytest.mark.parametrize("bad", [0.99, 0, -1, True, "1.2", None])
def test_a_bad_balance_is_refused(bad):
    with pytest.raises(ValueError, match="balance"):
        ChunkRouting(balance=bad)


@pytest.mark.parametrize("bad", [0, -1.0, True, "30", None])
def test_a_bad_placement_ttl_is_refused(bad):
    with pytest.raises(ValueError, match="placement_ttl_s"):
        ChunkRouting(placement_ttl_s=bad)


def test_forget_drops_only_the_lost_replicas_placements():
    routing = ChunkRouting()
    to_b = a_set_whose_home_is_not("replica-b")
    to_c = next(s for s in random_sets(seed=11) if home(REPLICAS, s) != "replica-c")
    routing.placed(to_b, "replica-b")
    routing.placed(to_c, "replica-c")
    routing.forget("replica-b")
    assert routing.rank(views(REPLICAS), to_b)[0] == [home(REPLICAS, to_b)]
    assert routing.rank(views(REPLICAS), to_c)[0] == ["replica-c"]


def test_remembered_placements_are_bounded_oldest_first():
    routing = ChunkRouting(remembered=2)
    singles = [[d] for s in random_sets(60) for d in s if home(REPLICAS, [d]) != "replica-b"][:3]
    for documents in singles:
        routing.placed(documents, "replica-b")
    assert routing.rank(views(REPLICAS), singles[0])[0] == [home(REPLICAS, singles[0])]  # the oldest, dropped
    assert all(routing.rank(views(REPLICAS), s)[0] == ["replica-b"] for s in singles[1:])
    nothing = ChunkRouting(remembered=0)
    nothing.placed(singles[0], "replica-b")
    assert nothing.rank(views(REPLICAS), singles[0])[0] == [home(REPLICAS, singles[0])]


# --------------------------------------------------------------------------- load spill, ranks
def test_a_long_queue_spills_to_the_least_loaded_replica():
    documents = random_sets(1)[0]
    preferred = home(REPLICAS, documents)
    others = [r for r in REPLICAS if r != preferred]
    routing = ChunkRouting(spill_threshold=3)
    spilled = [ReplicaView(preferred, queue=7), ReplicaView(others[0], queue=4), ReplicaView(others[1], queue=2)]
    ranks = routing.rank(spilled, documents)
    assert ranks[0] == [others[1]]  # 7 >= 3 + 2 * 2
    assert ranks[1][0] == preferred  # the home is still the next choice
    assert routing.home(spilled, documents) == preferred  # and still its home
    stays = [ReplicaView(preferred, queue=6), ReplicaView(others[0], queue=4), ReplicaView(others[1], queue=2)]
    assert routing.rank(stays, documents)[0] == [preferred]  # 6 < 3 + 2 * 2: a swing under load, not a pile-up
    idle = [ReplicaView(preferred, queue=3), ReplicaView(others[0], queue=0), ReplicaView(others[1], queue=1)]
    assert routing.rank(idle, documents)[0] == [others[0]]  # 3 >= 3 + 0: the others idle


def test_a_home_holding_the_documents_keeps_them_to_twice_the_bound():
    """What spills first is what the home would miss anyway: a request whose documents the home reports
    holding (at least half) waits there to twice the bound; one it reports not holding spills at the bound."""
    documents = random_sets(1)[0]
    preferred = home(REPLICAS, documents)
    others = [r for r in REPLICAS if r != preferred]
    routing = ChunkRouting(spill_threshold=3)

    def at(queue: int, shortest: int, held) -> list[ReplicaView]:
        return [ReplicaView(preferred, queue=queue, held=frozenset(held)), ReplicaView(others[0], queue=shortest + 3),
                ReplicaView(others[1], queue=shortest)]

    half = documents[: (len(documents) + 1) // 2]
    for held in (documents, half):
        assert routing.rank(at(5, 1, held), documents)[0] == [preferred]  # 5 < 2 * (3 + 2 * 1)
        assert routing.rank(at(9, 1, held), documents)[0] == [preferred]
        assert routing.rank(at(10, 1, held), documents)[0] == [others[1]]  # a hot set still cannot pin it
        assert routing.rank(at(6, 0, held), documents)[0] == [others[1]]  # 6 >= 2 * 3: the others idle
    assert routing.rank(at(5, 1, ()), documents)[0] == [others[1]]  # it holds none: 5 >= 3 + 2 * 1
    if len(documents) > 2:  # less than half held: it would miss most of them, so it spills at the bound
        assert routing.rank(at(5, 1, documents[:1]), documents)[0] == [others[1]]
    # The placements this router made are not holdings: an evicted set spills at the bound.
    routing.placed(documents, preferred)
    assert routing.rank(at(5, 1, ()), documents)[0] == [others[1]]


def test_a_spill_picks_the_best_ranked_of_equally_short_queues():
    documents = random_sets(1)[0]
    order = [ChunkRouting().rank(views(REPLICAS), documents)[0][0], *ChunkRouting().rank(views(REPLICAS),
                                                                                          documents)[1]]
    replicas = [ReplicaView(order[0], queue=9), ReplicaView(order[1], queue=0), ReplicaView(order[2], queue=0)]
    assert ChunkRouting().rank(replicas, documents)[0] == [order[1]]


def test_an_unknown_queue_never_spills():
    documents = random_sets(1)[0]
    preferred = home(REPLICAS, documents)
    replicas = [ReplicaView(r, queue=None if r == preferred else 0) for r in REPLICAS]
    assert ChunkRouting(spill_threshold=1).rank(replicas, documents)[0] == [preferred]
    alone_known = [ReplicaView(r, queue=50 if r == preferred else None) for r in REPLICAS]
    assert ChunkRouting(spill_threshold=1).rank(alone_known, documents)[0] == [preferred]


def test_no_documents_or_no_replicas_leave_the_choice_to_ray():
    assert ChunkRouting().rank(views(REPLICAS), []) == []
    assert ChunkRouting().rank([], ["abc"]) == []


@pytest.mark.parametrize("ids", [REPLICAS, ["only"], [f"r{i}" for i in range(7)]])
def test_the_second_rank_holds_every_other_replica_once(ids):
    for documents in random_sets(20):
        first, rest = ChunkRouting().rank(views(ids), documents)
        assert len(first) == 1 and first[0] not in rest
        assert sorted(first + rest) == sorted(ids)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3", None])
def test_a_bad_spill_threshold_is_refused(bad):
    with pytest.raises(ValueError, match="spill_threshold"):
        ChunkRouting(spill_threshold=bad)


@pytest.mark.parametrize("bad", [-1, False, 2.0, "10", None])
def test_a_bad_remembered_is_refused(bad):
    with pytest.raises(ValueError, match="remembered"):
        ChunkRouting(remembered=bad)


@pytest.mark.parametrize("stats, held", [
    (None, set()), ("documents", set()), (["a"], set()), (3, set()), ({}, set()), ({"documents": None}, set()),
    ({"documents": "abc"}, set()), ({"documents": {"a": 1}}, set()), ({"documents": ("a",)}, set()),
    ({"documents": ["a", 1, None, ["b"], {"c": 1}, "d", "a"]}, {"a", "d"}),
    ({"replica": "r1", "documents": ["x"]}, {"x"}),
])
def test_held_documents_tolerate_garbage_stats(stats, held):
    assert held_documents(stats) == frozenset(held)
