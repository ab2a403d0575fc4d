"""Arrival processes (rate and burstiness checked statistically), deterministic-traffic
flags, and the statistics helpers they are checked with."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from loadgen.stats import (
    exponential_cdf,
    gamma_cdf,
    ks_test,
    mean,
    percentile,
    regularized_gamma_p,
    std,
)
from loadgen.trace import TraceRequest
from loadgen.traffic import TrafficSpec, apply_traffic, arrival_times, deterministic_mask

N = 20_000


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


# ---- statistics helpers --------------------------------------------------------------------
@pytest.mark.parametrize("p", [0, 1, 25, 50, 75, 90, 99, 99.9, 100])
def test_percentile_matches_numpy(p: float) -> None:
    xs = [random.Random(1).gauss(0, 1) for _ in range(101)] + [3.0, -2.0, 7.5]
    assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), abs=1e-12)
    assert std(xs) == pytest.approx(float(np.std(xs)))


def test_empty_and_invalid_percentiles() -> None:
    assert percentile([], 50) == 0.0 and mean([]) == 0.0 and std([]) == 0.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_regularized_gamma_known_values() -> None:
    for x in (0.1, 1.0, 2.5, 10.0):                    # P(1, x) = 1 - e^-x
        assert regularized_gamma_p(1.0, x) == pytest.approx(1 - math.exp(-x), rel=1e-10)
    # P(2, x) = 1 - e^-x (1 + x); both series and continued-fraction branches
    for x in (0.5, 2.9, 3.1, 20.0):
        assert regularized_gamma_p(2.0, x) == pytest.approx(1 - math.exp(-x) * (1 + x), rel=1e-9)
    # P(1/2, x) = erf(sqrt(x))
    for x in (0.2, 1.7, 6.0):
        assert regularized_gamma_p(0.5, x) == pytest.approx(math.erf(math.sqrt(x)), rel=1e-9)


def test_ks_test_accepts_right_and_rejects_wrong_distribution() -> None:
    rng = random.Random(7)
    xs = [rng.expovariate(2.0) for _ in range(5000)]
    assert ks_test(xs, exponential_cdf(2.0))[1] > 0.01
    assert ks_test(xs, exponential_cdf(2.4))[1] < 1e-6
    bursty = [rng.gammavariate(0.25, 2.0) for _ in range(5000)]
    assert ks_test(bursty, exponential_cdf(2.0))[1] < 1e-6


# ---- arrival processes ---------------------------------------------------------------------
def test_offline_is_all_at_zero() -> None:
    assert arrival_times(5, TrafficSpec()) == [0.0] * 5


def test_poisson_rate_and_distribution() -> None:
    qps = 12.0
    times = arrival_times(N, TrafficSpec(qps=qps, seed=3))
    assert times[0] == 0.0 and times == sorted(times)
    gaps = _gaps(times)
    assert mean(gaps) == pytest.approx(1 / qps, rel=0.03)
    assert (N - 1) / times[-1] == pytest.approx(qps, rel=0.03)
    assert std(gaps) / mean(gaps) == pytest.approx(1.0, rel=0.05)     # CV of exponential
    d, p = ks_test(gaps, exponential_cdf(qps))
    assert p > 0.001, (d, p)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 3.0])
def test_gamma_burstiness(burstiness: float) -> None:
    qps = 5.0
    gaps = _gaps(arrival_times(N, TrafficSpec(qps=qps, burstiness=burstiness, seed=11)))
    assert mean(gaps) == pytest.approx(1 / qps, rel=0.04)
    assert std(gaps) / mean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)
    scale = 1.0 / (qps * burstiness)
    assert ks_test(gaps, gamma_cdf(burstiness, scale))[1] > 0.001
    if burstiness != 1.0:
        assert ks_test(gaps, exponential_cdf(qps))[1] < 1e-6


def test_seeds_reproduce_and_differ() -> None:
    a = arrival_times(100, TrafficSpec(qps=4, seed=1))
    assert a == arrival_times(100, TrafficSpec(qps=4, seed=1))
    assert a != arrival_times(100, TrafficSpec(qps=4, seed=2))


def test_linear_ramp_up_follows_integrated_rate() -> None:
    spec = TrafficSpec(qps=20.0, ramp_up_s=50.0, ramp_start_qps=2.0, seed=5)
    times = arrival_times(N, spec)

    def expected(t0: float, t1: float) -> float:      # integral of the rate over [t0, t1]
        def cum(t: float) -> float:
            if t <= 50.0:
                return 2.0 * t + (18.0 / 100.0) * t * t
            return cum(50.0) + 20.0 * (t - 50.0)
        return cum(t1) - cum(t0)

    for t0, t1 in ((0, 10), (10, 25), (25, 50), (50, 100), (100, 300)):
        count = sum(t0 <= t < t1 for t in times)
        exp = expected(t0, t1)
        assert abs(count - exp) < 4 * math.sqrt(exp) + 2, (t0, t1, count, exp)


def test_traffic_spec_validation() -> None:
    for bad in ({"qps": 0}, {"burstiness": 0}, {"deterministic_ratio": 1.5},
                {"ramp_up_s": 5}):
        with pytest.raises(ValueError):
            TrafficSpec(**bad)


# ---- deterministic flags -------------------------------------------------------------------
def test_deterministic_mask_exact_and_nested() -> None:
    n = 4096
    masks = {r: deterministic_mask(n, r, seed=9) for r in (0.0, 0.02, 0.05, 0.1, 0.5, 1.0)}
    for r, m in masks.items():
        assert sum(m) == round(r * n)
    ratios = sorted(masks)
    for lo, hi in zip(ratios, ratios[1:], strict=False):
        assert all(h or not lo_ for lo_, h in zip(masks[lo], masks[hi], strict=True))
    assert masks[0.5] != deterministic_mask(n, 0.5, seed=10)


def test_apply_traffic_sets_everything() -> None:
    reqs = [TraceRequest(f"r{i}", "p", 1, 4) for i in range(50)]
    spec = TrafficSpec(qps=10, deterministic_ratio=0.2, seed=1, sampling_seed=100,
                       temperature=0.8, logprobs=2)
    out = apply_traffic(reqs, spec)
    assert [r.id for r in out] == [r.id for r in reqs]
    assert sum(r.is_deterministic for r in out) == 10
    assert [r.seed for r in out] == list(range(100, 150))
    assert {r.temperature for r in out} == {0.8} and {r.logprobs for r in out} == {2}
    assert out == apply_traffic(reqs, spec)
