"""``ChunkAffinityRouter``: Ray Serve's request router for the engine replicas, routing by documents.

Ray builds one in every process that holds a handle to the engine deployment (the front end) and asks
it, per request, for replicas in order of preference; the choice itself is
:class:`~cacheblend_rag.server.replicas.routing.ChunkRouting`'s. The front end passes a request's
document digests as the ``documents`` keyword of its call; the replicas report what their memory tier
holds through ``record_routing_stats``. Ray then probes the first rank's queue and sends the request
there if it accepts, else tries the next rank.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cacheblend_rag.server.replicas.routing import DEFAULT_SPILL_THRESHOLD, ChunkRouting, ReplicaView, held_documents


class ChunkAffinityRouter(FIFOMixin, RequestRouter):
    """Prefers the replica whose memory tier holds most of a request's documents (``routing`` module)."""

    def initialize_state(self, spill_threshold: int = DEFAULT_SPILL_THRESHOLD, **kwargs: Any) -> None:
        self.routing = ChunkRouting(spill_threshold=spill_threshold)

    def _policy(self) -> ChunkRouting:
        if not hasattr(self, "routing"):  # Ray calls initialize_state with the config's kwargs; a bare one too
            self.initialize_state()
        return self.routing

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        documents = _documents_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [ReplicaView(id=rid, queue=self.replica_queue_len_cache.get(r.replica_id),
                             held=held_documents(r.routing_stats)) for rid, r in by_id.items()]
        # Placed on the first choice now (route): Ray calls on_request_routed only where replicas may refuse
        # requests (strict max_ongoing_requests), and the first rank takes it unless it is full.
        ranks = self._policy().route(views, documents)
        if not ranks:  # no documents: two random replicas, the shorter queue first (Ray's default)
            return _two_choices(candidate_replicas)
        return [[by_id[rid] for rid in rank] for rank in ranks if rank]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy().forget(replica_id.unique_id)


def _documents_of(pending_request: Optional[PendingRequest]) -> list[str]:
    documents = pending_request.kwargs.get("documents") if pending_request is not None else None
    return [d for d in documents if isinstance(d, str)] if isinstance(documents, (list, tuple)) else []


def _two_choices(candidates: List[RunningReplica]) -> List[List[RunningReplica]]:
    import random

    return [random.sample(candidates, min(2, len(candidates)))] if candidates else []


__all__ = ["ChunkAffinityRouter"]
