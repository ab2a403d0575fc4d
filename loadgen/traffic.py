"""When requests arrive and which of them ask for determinism.

Arrivals (vLLM's conventions): ``qps=inf`` is offline, everything at t=0. Otherwise the
gaps between requests are gamma distributed with shape ``burstiness`` and mean 1/qps:
burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular (the coefficient of
variation of the gaps is 1/sqrt(burstiness)). The first request arrives at t=0.

A linear ramp-up from ``ramp_start_qps`` to ``qps`` over ``ramp_up_s`` seconds uses the
time-rescaling theorem: unit-rate arrivals in "operational time" are mapped through the
inverse of the integrated rate, so the ramp is exact for any burstiness.

Deterministic flags: every request gets a seeded random rank; with ratio r the
``round(r * n)`` lowest ranks are deterministic. The count is exact and the sets are
nested (the 2% set is inside the 5% set), so runs at different ratios differ only where
they must.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from loadgen.trace import TraceRequest


@dataclass(frozen=True)
class TrafficSpec:
    qps: float = math.inf
    burstiness: float = 1.0
    ramp_up_s: float = 0.0
    ramp_start_qps: float = 0.0
    deterministic_ratio: float = 0.0
    seed: int = 0
    sampling_seed: int | None = None   # per-request seeds = sampling_seed + index; None: none
    temperature: float | None = None   # overrides the trace's temperature when set
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.qps > 0:
            raise ValueError("qps must be > 0 (inf for offline)")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be > 0")
        if self.ramp_up_s < 0 or self.ramp_start_qps < 0:
            raise ValueError("ramp-up values must be >= 0")
        if self.ramp_up_s > 0 and math.isinf(self.qps):
            raise ValueError("a ramp-up needs a finite qps")
        if not 0.0 <= self.deterministic_ratio <= 1.0:
            raise ValueError("deterministic_ratio must be in [0, 1]")

    @property
    def offline(self) -> bool:
        return math.isinf(self.qps)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["qps"] = "inf" if self.offline else self.qps
        return d


def arrival_times(n: int, spec: TrafficSpec) -> list[float]:
    """``n`` non-decreasing arrival offsets in seconds, reproducible from ``spec.seed``."""
    if spec.offline:
        return [0.0] * n
    rng = random.Random(spec.seed)
    shape = spec.burstiness
    unit: list[float] = []      # operational time: arrivals of a rate-1 process
    t = 0.0
    for i in range(n):
        if i > 0:
            t += rng.gammavariate(shape, 1.0 / shape)
        unit.append(t)
    return [_invert_integrated_rate(u, spec) for u in unit]


def _invert_integrated_rate(u: float, spec: TrafficSpec) -> float:
    """t such that the integral of rate(s) ds over [0, t] equals u."""
    r1 = spec.qps
    ramp = spec.ramp_up_s
    if ramp <= 0:
        return u / r1
    r0 = spec.ramp_start_qps
    area = (r0 + r1) * ramp / 2.0          # operational time spent during the ramp
    if u >= area:
        return ramp + (u - area) / r1
    a = (r1 - r0) / (2.0 * ramp)            # solve a t^2 + r0 t - u = 0
    if a == 0:
        return u / r0
    return (-r0 + math.sqrt(r0 * r0 + 4.0 * a * u)) / (2.0 * a)


def deterministic_mask(n: int, ratio: float, seed: int) -> list[bool]:
    """Exactly ``round(ratio * n)`` True values, at seeded positions, nested across ratios."""
    ranks = list(range(n))
    random.Random(seed ^ 0x5EED).shuffle(ranks)
    k = round(ratio * n)
    return [rank < k for rank in ranks]


def apply_traffic(requests: Sequence[TraceRequest], spec: TrafficSpec) -> list[TraceRequest]:
    """Copies of ``requests`` (in their order) with arrivals, flags and seeds set."""
    times = arrival_times(len(requests), spec)
    mask = deterministic_mask(len(requests), spec.deterministic_ratio, spec.seed)
    out = []
    for i, (req, t, det) in enumerate(zip(requests, times, mask, strict=True)):
        changes: dict[str, Any] = {"arrival_s": t, "is_deterministic": det}
        if spec.sampling_seed is not None:
            changes["seed"] = spec.sampling_seed + i
        if spec.temperature is not None:
            changes["temperature"] = spec.temperature
        if spec.logprobs is not None:
            changes["logprobs"] = spec.logprobs
        out.append(replace(req, **changes))
    return out
