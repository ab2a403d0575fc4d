"""Saturation and the latency targets, from run results (loadgen's run JSON; pure).

**Keeping up.** A run at offered rate ``lambda`` keeps up when every request succeeded (none
failed or ran past the run's deadline) and its keep-up ratio is at least ``min_ratio``
(0.9). The keep-up ratio compares the first and the last quarter of the requests by arrival:

    ratio = da / (da + dE)      da = median arrival of the last quarter - of the first
                                dE = median E2E latency of the last quarter - of the first
                                     (0 when negative, so the ratio is at most 1)

A server that keeps up serves late requests as fast as early ones (dE ~ 0, ratio ~ 1). One
that does not builds a backlog: a request arriving at t waits about (lambda/mu - 1) t more,
and the ratio comes out as mu / lambda, the achieved throughput over the offered one. Unlike
completions / duration, the ratio does not count the drain after the last arrival, so it
holds for the short windows a time budget allows. The early requests meet a server still
filling up, which pulls the ratio a little below 1 on a server that does keep up: hence 0.9.

**Saturation rate** of a series on a dataset: the highest rate of the sweep such that the run
at that rate and every run at a lower rate keep up. ``reached`` says whether some run did
not keep up (else the saturation rate is only a lower bound: the sweep stopped too early);
with the lowest rate already failing it is None.

**Targets** (issue 37, 8B shape, one GPU):
- E2E: at 10 % deterministic traffic, P99 end-to-end latency of all requests within 5 % of
  nondeterministic's at the same rate, at every rate up to 80 % of nondeterministic's
  saturation rate;
- TTFT: in every run with both kinds of requests, the deterministic requests' P99 TTFT
  within 1.2x of the non-deterministic ones'.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadgen.stats import median

MIN_KEEP_UP = 0.9
E2E_TOLERANCE = 1.05      # llm42 @10 % P99 E2E / nondeterministic's
TTFT_TOLERANCE = 1.2      # deterministic P99 TTFT / non-deterministic's, same run
TARGET_FRACTION = 0.8     # of nondeterministic's saturation rate
TARGET_RATIO = 0.1


def label(run: dict[str, Any], key: str, default: Any = None) -> Any:
    return run.get("labels", {}).get(key, default)


def rate_of(run: dict[str, Any]) -> float:
    q = label(run, "qps", run.get("request_rate"))
    return math.inf if q in (None, "inf") else float(q)


def series_of(run: dict[str, Any]) -> str:
    return str(label(run, "series", f"{label(run, 'mode')}@{label(run, 'ratio')}"))


def keep_up_ratio(starts: Sequence[float], e2els: Sequence[float]) -> float | None:
    """The keep-up ratio (module docstring) of requests sent at ``starts`` that took
    ``e2els`` (seconds; successful requests only); None with fewer than 4 requests."""
    if len(starts) != len(e2els):
        raise ValueError("starts and e2els differ in length")
    n = len(starts)
    if n < 4:
        return None
    order = sorted(range(n), key=lambda i: starts[i])
    q = n // 4
    first, last = order[:q], order[-q:]
    da = median([starts[i] for i in last]) - median([starts[i] for i in first])
    de = max(0.0, median([e2els[i] for i in last]) - median([e2els[i] for i in first]))
    if da <= 0:
        return None
    return da / (da + de)


@dataclass(frozen=True)
class KeepUp:
    ratio: float | None
    failed: int
    kept_up: bool
    why: str


def keeps_up(run: dict[str, Any], min_ratio: float = MIN_KEEP_UP) -> KeepUp:
    errors = run.get("errors") or [""] * len(run.get("e2els", []))
    ok = [not e for e in errors]
    starts = [s for s, good in zip(run.get("starts", []), ok, strict=False) if good]
    e2els = [e for e, good in zip(run.get("e2els", []), ok, strict=False) if good]
    failed = int(run.get("failed", len(ok) - sum(ok)))
    ratio = keep_up_ratio(starts, e2els) if len(starts) == len(e2els) else None
    if failed:
        return KeepUp(ratio, failed, False, f"{failed} request(s) failed or timed out")
    if ratio is None:
        return KeepUp(ratio, failed, False, "too few requests to tell")
    if ratio < min_ratio:
        return KeepUp(ratio, failed, False, f"keep-up ratio {ratio:.2f} < {min_ratio:g}")
    return KeepUp(ratio, failed, True, f"keep-up ratio {ratio:.2f}")


@dataclass(frozen=True)
class Saturation:
    dataset: str
    series: str
    rate: float | None     # None: the lowest rate already failed
    reached: bool          # a run of the sweep did not keep up
    rates: tuple[float, ...]
    kept_up: tuple[bool, ...]

    def describe(self) -> str:
        if self.rate is None:
            return f"< {min(self.rates):g} req/s (the lowest rate did not keep up)"
        return f"{self.rate:g} req/s" if self.reached else \
            f">= {self.rate:g} req/s (every rate kept up: not reached)"


def saturation(runs: Iterable[dict[str, Any]], dataset: str, series: str,
               min_ratio: float = MIN_KEEP_UP) -> Saturation | None:
    """The saturation rate of ``series`` on ``dataset`` (module docstring); None without
    runs."""
    mine = sorted((r for r in runs if label(r, "dataset") == dataset
                   and series_of(r) == series and math.isfinite(rate_of(r))), key=rate_of)
    if not mine:
        return None
    rates = tuple(rate_of(r) for r in mine)
    kept = tuple(keeps_up(r, min_ratio).kept_up for r in mine)
    best: float | None = None
    for rate, ok in zip(rates, kept, strict=True):
        if not ok:
            return Saturation(dataset, series, best, True, rates, kept)
        best = rate
    return Saturation(dataset, series, best, False, rates, kept)


@dataclass(frozen=True)
class Check:
    target: str
    dataset: str
    rate: float
    series: str
    value: float | None     # the measured ratio
    bound: float
    passed: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _p99(run: dict[str, Any], metric: str, part: str | None = None) -> float | None:
    src = run if part is None else run.get(part) or {}
    if part is not None and not src.get("completed"):
        return None
    v = src.get(f"p99_{metric}_ms")
    return float(v) if v is not None else None


def e2e_checks(runs: Sequence[dict[str, Any]], dataset: str,
               baseline: str = "nondeterministic@0", series: str = "llm42@0.1",
               min_ratio: float = MIN_KEEP_UP) -> tuple[list[Check], str]:
    """The E2E target on one dataset: one check per rate up to 80 % of the baseline's
    saturation rate where both series ran. Returns the checks and a note on the range."""
    sat = saturation(runs, dataset, baseline, min_ratio)
    if sat is None:
        return [], f"{dataset}: no {baseline} runs, so no E2E check"
    if sat.rate is None:
        return [], f"{dataset}: {baseline} kept up at no rate, so no range to check"
    limit = TARGET_FRACTION * sat.rate
    note = (f"{dataset}: rates up to {limit:.3g} req/s = {TARGET_FRACTION:g} x "
            f"{baseline}'s saturation rate {sat.describe()}")
    base = {rate_of(r): r for r in runs if label(r, "dataset") == dataset
            and series_of(r) == baseline}
    other = {rate_of(r): r for r in runs if label(r, "dataset") == dataset
             and series_of(r) == series}
    checks = []
    for rate in sorted(set(base) & set(other)):
        if rate > limit * (1 + 1e-9):
            continue
        a, b = _p99(other[rate], "e2el"), _p99(base[rate], "e2el")
        value = a / b if a is not None and b else None
        passed = value is not None and value <= E2E_TOLERANCE and not other[rate].get("failed")
        checks.append(Check("e2e_p99_10pct", dataset, rate, series, value, E2E_TOLERANCE,
                            passed, f"P99 E2E {_ms(a)} vs {baseline} {_ms(b)}"))
    if not checks:
        note += f"; no rate of both {series} and {baseline} in that range"
    return checks, note


def ttft_checks(runs: Sequence[dict[str, Any]]) -> list[Check]:
    """The TTFT target: every run with deterministic and non-deterministic requests."""
    checks = []
    for r in runs:
        det, nondet = _p99(r, "ttft", "deterministic"), _p99(r, "ttft", "non_deterministic")
        if det is None or nondet is None:
            continue
        value = det / nondet if nondet else None
        checks.append(Check("ttft_p99_det", str(label(r, "dataset")), rate_of(r),
                            series_of(r), value, TTFT_TOLERANCE,
                            value is not None and value <= TTFT_TOLERANCE,
                            f"P99 TTFT deterministic {_ms(det)}, non-deterministic "
                            f"{_ms(nondet)}"))
    return sorted(checks, key=lambda c: (c.dataset, c.series, c.rate))


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"
