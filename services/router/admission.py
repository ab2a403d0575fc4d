"""Load shedding: a bounded number of sequences in flight; above it, answer 429.

Runs on the router replica's event loop only (no locks). Decoders queue what they are
given, so without this bound a burst would queue without limit and every request would
time out; with it, excess requests fail fast with ``Retry-After``.
"""

from __future__ import annotations

from services.router.errors import overloaded


class Slot:
    """Capacity held by one request; ``release`` is idempotent."""

    def __init__(self, owner: Admission, sequences: int) -> None:
        self._owner = owner
        self._sequences = sequences

    def release(self) -> None:
        if self._sequences:
            self._owner.active -= self._sequences
            self._sequences = 0


class Admission:
    def __init__(self, max_outstanding: int, retry_after_s: int = 1) -> None:
        if max_outstanding < 1:
            raise ValueError("max_outstanding must be >= 1")
        self.max_outstanding = max_outstanding
        self.retry_after_s = retry_after_s
        self.active = 0
        self.shed = 0

    def acquire(self, sequences: int) -> Slot:
        """Hold ``sequences`` slots until ``Slot.release``; raises the 429 ``APIError``
        when they do not fit."""
        if self.active + sequences > self.max_outstanding:
            self.shed += 1
            raise overloaded(self.retry_after_s)
        self.active += sequences
        return Slot(self, sequences)
