"""The verifier interface: lane passes in, decisions out.

The engine never runs lane passes itself; it submits them to a ``Verifier`` and applies
the results it polls. ``InProcessVerifier`` runs them on the engine's own runner (sharing
its KV pool); the serving layer provides one that talks to a verifier actor over gRPC.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from detserve.executor.runner import ModelRunner
from detserve.lane import LanePass, LaneResult


class Verifier(Protocol):
    def submit(self, lane_pass: LanePass) -> None:
        """Queue a pass. Must not block on other passes' results."""

    def poll(self, wait: bool = False) -> list[LaneResult]:
        """Results that are ready; with ``wait``, block until at least one is (if any is
        in flight)."""

    def in_flight(self) -> int: ...

    def close(self) -> None: ...


class InProcessVerifier:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._done: deque[LaneResult] = deque()

    def submit(self, lane_pass: LanePass) -> None:
        self._done.append(self.runner.run_lane(lane_pass))

    def poll(self, wait: bool = False) -> list[LaneResult]:
        out = list(self._done)
        self._done.clear()
        return out

    def in_flight(self) -> int:
        return len(self._done)

    def close(self) -> None:
        self._done.clear()
