"""Ray Serve request router for the Decoder deployment: ``TokenLedger`` policy.

Configured on the deployment (``RequestRouterConfig(request_router_class=...)``), so every
handle to decoders routes this way. Only ``generate`` calls carry a ``DecodeRequest``; a
``channel`` call carries a ``ChannelOpen`` and goes to the replica it names, as does any
call whose first argument is a ``ReplicaPin``; other calls (stats, ping) go to any replica.
A replayed request (``DecodeRequest.avoid``) goes to a replica other than those that failed
it, while there is one.
"""

from __future__ import annotations

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from services.decoder.messages import ChannelOpen, DecodeRequest, ReplicaPin
from services.router.load_ledger import TokenLedger


def _first_arg(pending: PendingRequest | None) -> object:
    return pending.args[0] if pending is not None and pending.args else None


def _decode_request(pending: PendingRequest | None) -> DecodeRequest | None:
    arg = _first_arg(pending)
    return arg if isinstance(arg, DecodeRequest) else None


def _pinned_replica(pending: PendingRequest | None) -> str | None:
    arg = _first_arg(pending)
    return arg.replica if isinstance(arg, (ChannelOpen, ReplicaPin)) else None


class LeastTokensRouter(RequestRouter):
    def initialize_state(self, affinity_slack_tokens: int = 4096,  # type: ignore[override]
                         affinity_capacity: int = 8192) -> None:
        self._ledger = TokenLedger(affinity_slack_tokens, affinity_capacity)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # when no rank accepts, back off instead of spinning
            pending_request.routing_context.should_backoff = True
        pinned = _pinned_replica(pending_request)
        if pinned is not None:  # a router's channel, a pinned call: that replica or none
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pinned]]
        req = _decode_request(pending_request)
        if req is None:
            return [candidate_replicas]
        if req.avoid:  # a replay: not to a replica that failed it, while another is up
            others = [r for r in candidate_replicas if r.replica_id.unique_id not in req.avoid]
            candidate_replicas = others or candidate_replicas
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranked = self._ledger.rank(list(by_id), req.affinity)
        return [[by_id[rid]] for rid in ranked]  # type: ignore[index]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        req = _decode_request(pending_request)
        if req is not None:
            self._ledger.routed(pending_request.metadata.internal_request_id, replica_id,
                                req.cost_tokens, req.affinity)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ledger.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ledger.forget(replica_id)
