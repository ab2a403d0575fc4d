"""Routing bookkeeping (no Ray): outstanding tokens per decoder and prefix affinity.

A request costs ``prompt + max_tokens`` tokens on the replica it is routed to until it
completes. Replicas are ranked by outstanding tokens; a deterministic request goes first
to the replica that last served its longest known prompt prefix (its lane-computed KV may
be reusable there), unless that replica carries more than ``affinity_slack_tokens``
above the least loaded one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence


class TokenLedger:
    def __init__(self, affinity_slack_tokens: int = 4096, affinity_capacity: int = 8192) -> None:
        self.affinity_slack_tokens = affinity_slack_tokens
        self.affinity_capacity = affinity_capacity
        self._load: dict[Hashable, int] = {}
        self._inflight: dict[Hashable, tuple[Hashable, int]] = {}
        self._affinity: OrderedDict[int, Hashable] = OrderedDict()
        self._tiebreak = itertools.count()

    def load(self, replica: Hashable) -> int:
        return self._load.get(replica, 0)

    def rank(self, candidates: Sequence[Hashable], keys: Sequence[int] = ()) -> list[Hashable]:
        """Candidates, best first: least outstanding tokens (ties rotate), the affine
        replica first when it is within the slack."""
        if not candidates:
            return []
        turn = next(self._tiebreak)
        order = sorted(range(len(candidates)),
                       key=lambda i: (self.load(candidates[i]), (i - turn) % len(candidates)))
        ranked = [candidates[i] for i in order]
        preferred = self._affine(keys, ranked)
        if preferred is not None and self.load(preferred) <= self.load(ranked[0]) + \
                self.affinity_slack_tokens:
            ranked.remove(preferred)
            ranked.insert(0, preferred)
        return ranked

    def _affine(self, keys: Sequence[int], candidates: Sequence[Hashable]) -> Hashable | None:
        for key in keys:
            replica = self._affinity.get(key)
            if replica is not None and replica in candidates:
                return replica
        return None

    def routed(self, request: Hashable, replica: Hashable, cost: int,
               keys: Sequence[int] = ()) -> None:
        self._inflight[request] = (replica, cost)
        self._load[replica] = self.load(replica) + cost
        for key in keys:
            self._affinity[key] = replica
            self._affinity.move_to_end(key)
        while len(self._affinity) > self.affinity_capacity:
            self._affinity.popitem(last=False)

    def completed(self, request: Hashable) -> None:
        entry = self._inflight.pop(request, None)
        if entry is not None:
            replica, cost = entry
            self._load[replica] = self.load(replica) - cost

    def forget(self, replica: Hashable) -> None:
        """A replica died: drop its load and affinities."""
        self._load.pop(replica, None)
        for request in [r for r, (rep, _) in self._inflight.items() if rep == replica]:
            del self._inflight[request]
        for key in [k for k, rep in self._affinity.items() if rep == replica]:
            del self._affinity[key]

    def check_integrity(self) -> None:
        totals: dict[Hashable, int] = {}
        for replica, cost in self._inflight.values():
            totals[replica] = totals.get(replica, 0) + cost
        for replica, load in self._load.items():
            assert load == totals.get(replica, 0), f"ledger of {replica} is off"
