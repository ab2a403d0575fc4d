"""Small numpy/scipy-free statistics: summaries, percentiles, distribution CDFs, KS test.

Percentiles use linear interpolation between closest ranks, the same rule as numpy's
default (``np.percentile(..., method="linear")``), so our numbers match vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def mean(xs: Sequence[float]) -> float:
    """Arithmetic mean; 0.0 for an empty sequence (vLLM reports 0 for missing metrics)."""
    return math.fsum(xs) / len(xs) if xs else 0.0


def std(xs: Sequence[float]) -> float:
    """Population standard deviation (numpy's default ddof=0); 0.0 when empty."""
    if not xs:
        return 0.0
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs))


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation; 0.0 when empty."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not xs:
        return 0.0
    s = sorted(xs)
    rank = (len(s) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50.0)


def ecdf(xs: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical CDF heights (i/n), ready to plot as a step line."""
    s = sorted(xs)
    n = len(s)
    return s, [(i + 1) / n for i in range(n)]


def exponential_cdf(rate: float) -> Callable[[float], float]:
    return lambda x: 0.0 if x <= 0 else 1.0 - math.exp(-rate * x)


def gamma_cdf(shape: float, scale: float) -> Callable[[float], float]:
    """CDF of Gamma(shape, scale): the regularized lower incomplete gamma P(shape, x/scale)."""
    return lambda x: 0.0 if x <= 0 else regularized_gamma_p(shape, x / scale)


def regularized_gamma_p(a: float, x: float) -> float:
    """P(a, x) by its power series for x < a + 1 and a continued fraction otherwise."""
    if a <= 0:
        raise ValueError("a must be > 0")
    if x <= 0:
        return 0.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return min(1.0, total * math.exp(log_prefix))
    # Lentz's continued fraction for Q(a, x) = 1 - P(a, x).
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return max(0.0, 1.0 - math.exp(log_prefix) * h)


def ks_statistic(xs: Sequence[float], cdf: Callable[[float], float]) -> float:
    """One-sample Kolmogorov-Smirnov statistic D = sup |F_n(x) - F(x)|."""
    s = sorted(xs)
    n = len(s)
    d = 0.0
    for i, x in enumerate(s):
        f = cdf(x)
        d = max(d, (i + 1) / n - f, f - i / n)
    return d


def ks_pvalue(d: float, n: int) -> float:
    """Asymptotic p-value of the KS statistic (Kolmogorov distribution, with Stephens'
    small-sample correction); accurate enough for n >= ~35."""
    if n <= 0:
        raise ValueError("n must be > 0")
    sqrt_n = math.sqrt(n)
    lam = (sqrt_n + 0.12 + 0.11 / sqrt_n) * d
    if lam < 1e-3:
        return 1.0
    total = 0.0
    for k in range(1, 200):
        term = 2.0 * (-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam)
        total += term
        if abs(term) < 1e-12:
            break
    return min(1.0, max(0.0, total))


def ks_test(xs: Sequence[float], cdf: Callable[[float], float]) -> tuple[float, float]:
    """(D, p-value) of a one-sample KS test of ``xs`` against ``cdf``."""
    d = ks_statistic(xs, cdf)
    return d, ks_pvalue(d, len(xs))
