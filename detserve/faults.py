"""Fault injection, for tests and benchmarks only (``EngineConfig.fastpath_perturbation``).

It models fast-path drift: a sampled fast-path token is replaced by another one with the
configured probability, so the lane has windows to reject and roll back. It hits every
fast-path token (lane-verified candidates and the final tokens of non-deterministic
requests alike), never lane or batch-invariant math. The draws come from one seeded
``random.Random``, one per sampled row in batch order (and a second for the offset where
the first hits): tests rely on that order to reproduce a run.
"""

from __future__ import annotations

import random

import torch

from detserve.executor.transfer import upload


class FastPathFaults:
    def __init__(self, probability: float, vocab_size: int, seed: int) -> None:
        self.probability = probability
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)

    def draw(self, rows: int) -> dict[int, int]:
        """Per sampled row of a batch (0 .. rows-1) that is hit: the offset added to its
        token, modulo the vocabulary (never 0: the token changes)."""
        offsets: dict[int, int] = {}
        for j in range(rows):
            if self._rng.random() < self.probability:
                offsets[j] = 1 + self._rng.randrange(self.vocab_size - 1)
        return offsets

    def perturb(self, tokens: torch.Tensor, offsets: dict[int, int]) -> torch.Tensor:
        """``tokens`` (a batch's sampled tokens on the device) with ``offsets`` applied,
        as the host would read them; ``tokens`` itself is left unchanged."""
        at = upload(list(offsets), tokens.device)
        add = upload(list(offsets.values()), tokens.device)
        out = tokens.clone()
        out[at] = (out[at] + add) % self.vocab_size
        return out

    def apply(self, token: int, offset: int) -> int:
        """A token read back on the host, with its row's offset (0: not hit)."""
        return (token + offset) % self.vocab_size
