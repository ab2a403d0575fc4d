"""Ray Serve request router for the Decoder deployment: calls pinned to one replica.

Requests never go through Ray Serve handle calls (they go over links, ``services.router.
links``, which route by outstanding tokens); handle calls carry control only. A call whose
first argument is a ``ReplicaPin`` goes to the replica it names or nowhere (per-replica
``stats``); any other call (``stats``, ``profile``, ``ping``) goes to any replica.
"""

from __future__ import annotations

from ray.serve.request_router import (
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from services.decoder.messages import ReplicaPin


def _pinned_replica(pending: PendingRequest | None) -> str | None:
    arg = pending.args[0] if pending is not None and pending.args else None
    return arg.replica if isinstance(arg, ReplicaPin) else None


class PinningRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # when no rank accepts, back off instead of spinning
            pending_request.routing_context.should_backoff = True
        pinned = _pinned_replica(pending_request)
        if pinned is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pinned]]
        return [candidate_replicas]
