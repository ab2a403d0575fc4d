"""What a campaign runs, and what its time budget cuts (pure: no I/O, no torch).

A campaign is a list of *series* (a server configuration and the share of deterministic
requests sent to it) replayed on *datasets* at a list of request rates. Rates are given
per dataset, or as fractions of the capacity that a burst probe measures on the first
series' server (nondeterministic by default), so one plan serves any GPU.

Every run of the campaign gets the same arrival window ``w`` (its request count is
``rate * w``), followed by up to its dataset's ``drain_s`` for the last requests to finish.
The planner picks ``w`` so that the estimate

    server starts and stops + capacity probes + sum over runs of (w + drain_s)

fits the budget; where even the shortest window (``min_window_s``) does not fit, it drops
runs from the end of the priority order (dataset, then series, then rate, each in the order
given) and says which. The driver enforces the budget again as it goes (it skips what no
longer fits), since the estimate is only an estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerSpec:
    """One `detserve serve` configuration: its engine mode, its flags, and flags used only
    on CUDA (``--mps`` co-locates the verifier's kernels through MPS)."""

    mode: str
    flags: tuple[str, ...] = ()
    cuda_flags: tuple[str, ...] = ()

    def args(self, device: str) -> tuple[str, ...]:
        extra = self.cuda_flags if device.startswith("cuda") else ()
        return ("--mode", self.mode, *self.flags, *extra)


# The servers a series can name. ``llm42-dedicated`` puts the verifier on a GPU of its own
# (issue 35's ``--dedicated-verifiers``: two GPUs; a server that cannot start, e.g. on one
# GPU or on a build without that flag, leaves its runs reported as skipped).
SERVERS: dict[str, ServerSpec] = {
    "nondeterministic": ServerSpec("nondeterministic", ("--num-verifiers", "0")),
    "llm42": ServerSpec("llm42", ("--num-verifiers", "1"), cuda_flags=("--mps",)),
    "batch_invariant": ServerSpec("batch_invariant", ("--num-verifiers", "0")),
    "llm42-dedicated": ServerSpec("llm42", ("--num-verifiers", "1", "--dedicated-verifiers")),
}
DEFAULT_SERIES = ("nondeterministic@0", "llm42@0.1", "llm42@1", "batch_invariant@1",
                  "llm42@0.5")


@dataclass(frozen=True)
class Series:
    server: str
    ratio: float   # share of deterministic requests

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"series {self.server}: ratio must be in [0, 1]")

    @property
    def name(self) -> str:
        return f"{self.server}@{self.ratio:g}"

    @classmethod
    def parse(cls, text: str, servers: Mapping[str, ServerSpec] = SERVERS) -> Series:
        """``SERVER@RATIO`` (e.g. ``llm42@0.1``); the server must be in ``servers``."""
        server, sep, ratio = text.strip().partition("@")
        if not sep:
            raise ValueError(f"series {text!r}: write SERVER@RATIO, e.g. llm42@0.1")
        if server not in servers:
            raise ValueError(f"series {text!r}: unknown server {server!r}; known: "
                             f"{', '.join(servers)}")
        return cls(server, float(ratio))


@dataclass(frozen=True)
class DatasetPlan:
    """A base trace to replay and how long its last requests may take to finish."""

    name: str
    trace: str          # JSONL trace file (``online_campaign prepare`` writes them)
    drain_s: float      # allowed after the last arrival (about the longest E2E under load)

    def __post_init__(self) -> None:
        if self.drain_s <= 0:
            raise ValueError(f"dataset {self.name}: drain_s must be > 0")


@dataclass(frozen=True)
class TimeModel:
    """Estimates the planner budgets with (seconds)."""

    start_s: float = 60.0       # one server start: Ray, Redis, replicas, warm-up requests
    stop_s: float = 10.0
    probe_s: float = 20.0       # one capacity probe (a burst), per dataset
    min_window_s: float = 6.0   # a shorter arrival window says little
    max_window_s: float = 120.0
    min_requests: int = 8       # per run, whatever its rate

    def __post_init__(self) -> None:
        if not 0 < self.min_window_s <= self.max_window_s:
            raise ValueError("need 0 < min_window_s <= max_window_s")
        if self.min_requests < 1:
            raise ValueError("min_requests must be >= 1")


@dataclass(frozen=True)
class CellPlan:
    """One run: a series on a dataset at a rate point (an index into the dataset's rates
    or the capacity fractions)."""

    dataset: str
    series: Series
    point: int

    @property
    def key(self) -> str:
        return f"{self.dataset}/{self.series.name}/{self.point}"


@dataclass(frozen=True)
class CampaignPlan:
    datasets: tuple[DatasetPlan, ...]
    series: tuple[Series, ...]
    fractions: tuple[float, ...] = (0.4, 0.8, 1.0)
    rates: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # explicit, per dataset
    servers: Mapping[str, ServerSpec] = field(default_factory=lambda: dict(SERVERS))

    def __post_init__(self) -> None:
        if not self.datasets or not self.series:
            raise ValueError("a campaign needs at least one dataset and one series")
        if any(not f > 0 for f in self.fractions):
            raise ValueError("capacity fractions must be > 0")
        for name, rates in self.rates.items():
            if name not in {d.name for d in self.datasets}:
                raise ValueError(f"rates given for {name!r}, which is not a dataset of the plan")
            if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
                raise ValueError(f"{name}: rates must be finite and > 0")
        for s in self.series:
            if s.server not in self.servers:
                raise ValueError(f"series {s.name}: unknown server {s.server!r}")

    def points(self, dataset: str) -> int:
        return len(self.rates.get(dataset, self.fractions))

    def needs_probe(self, dataset: str) -> bool:
        return dataset not in self.rates

    def rate(self, dataset: str, point: int, capacity: float | None) -> float:
        """The request rate of a rate point: explicit, or a fraction of ``capacity``."""
        if dataset in self.rates:
            return self.rates[dataset][point]
        if capacity is None or not capacity > 0:
            raise ValueError(f"{dataset}: no capacity measured, so no rate for fraction "
                             f"{self.fractions[point]}")
        return self.fractions[point] * capacity

    def cells(self) -> list[CellPlan]:
        """Every run, in priority order (dataset, series, rate point)."""
        return [CellPlan(d.name, s, i) for d in self.datasets for s in self.series
                for i in range(self.points(d.name))]

    def server_order(self, cells: Sequence[CellPlan]) -> list[str]:
        """The servers to start, in the order the series name them (one start each)."""
        return list(dict.fromkeys(c.series.server for c in self.series_cells(cells)))

    def series_cells(self, cells: Sequence[CellPlan]) -> list[CellPlan]:
        order = {s: i for i, s in enumerate(self.series)}
        return sorted(cells, key=lambda c: order[c.series])

    def to_json(self) -> dict[str, Any]:
        return {"datasets": [vars(d) for d in self.datasets],
                "series": [s.name for s in self.series], "fractions": list(self.fractions),
                "rates": {k: list(v) for k, v in self.rates.items()},
                "servers": {k: {"mode": v.mode, "flags": list(v.flags),
                                "cuda_flags": list(v.cuda_flags)}
                            for k, v in self.servers.items()}}


@dataclass(frozen=True)
class Budgeted:
    """The planner's answer: the runs kept, their common arrival window, the estimate of
    the whole campaign, and the runs cut (with why)."""

    cells: tuple[CellPlan, ...]
    window_s: float
    estimate_s: float
    cuts: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"cells": [c.key for c in self.cells], "window_s": self.window_s,
                "estimate_s": self.estimate_s, "cuts": list(self.cuts)}


def fixed_cost(plan: CampaignPlan, cells: Sequence[CellPlan], tm: TimeModel) -> float:
    """Server starts and stops plus capacity probes of ``cells``."""
    servers = len(plan.server_order(cells))
    probes = sum(plan.needs_probe(d) for d in dict.fromkeys(c.dataset for c in cells))
    return servers * (tm.start_s + tm.stop_s) + probes * tm.probe_s


def estimate(plan: CampaignPlan, cells: Sequence[CellPlan], window_s: float,
             tm: TimeModel) -> float:
    drains = {d.name: d.drain_s for d in plan.datasets}
    return fixed_cost(plan, cells, tm) + sum(window_s + drains[c.dataset] for c in cells)


def budget_cells(plan: CampaignPlan, budget_s: float, tm: TimeModel | None = None) -> Budgeted:
    """The runs that fit ``budget_s`` and their common arrival window (see the module)."""
    tm = tm or TimeModel()
    if not budget_s > 0:
        raise ValueError("the budget must be > 0 seconds")
    cells = plan.cells()
    cuts: list[str] = []
    while cells:
        window = _window(plan, cells, budget_s, tm)
        if window >= tm.min_window_s:
            window = min(window, tm.max_window_s)
            return Budgeted(tuple(cells), window, estimate(plan, cells, window, tm),
                            tuple(cuts))
        dropped = cells.pop()
        cuts.append(f"{dropped.key}: no room in {budget_s:g} s at a {tm.min_window_s:g} s "
                    "window")
    raise ValueError(f"not even one run fits {budget_s:g} s (a server start alone is "
                     f"estimated at {tm.start_s:g} s)")


def _window(plan: CampaignPlan, cells: Sequence[CellPlan], budget_s: float,
            tm: TimeModel) -> float:
    drains = {d.name: d.drain_s for d in plan.datasets}
    left = budget_s - fixed_cost(plan, cells, tm) - sum(drains[c.dataset] for c in cells)
    return left / len(cells)


def num_requests(rate: float, window_s: float, tm: TimeModel, available: int) -> int:
    """Requests of a run at ``rate`` over the window, at least ``min_requests``, at most
    what the base trace holds."""
    return max(1, min(available, max(tm.min_requests, round(rate * window_s))))
