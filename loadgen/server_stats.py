"""Server-side counters: read them (Prometheus text or engine.stats()) and diff two reads.

Prometheus names are normalised to the engine's ``stats()`` keys: the ``detserve:`` (or
``vllm:``/``sglang:``) prefix and a counter's ``_total`` suffix are dropped and label sets
are summed, so ``detserve:rollbacks_total{replica="0"}`` and ``engine.stats()["rollbacks"]``
both land in ``rollbacks``. A run reports the difference between the counters read just
before and just after it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

PREFIXES = ("detserve:", "vllm:", "sglang:")
# Counters that Table 4 and the run summary report, in the engine's naming.
DVR_KEYS = ("verify_passes", "windows", "rollbacks", "tokens_rolled_back", "recomputed_tokens",
            "lane_padding_rows", "committed_tokens", "fast_tokens")


def parse_prometheus(text: str, prefixes: tuple[str, ...] = PREFIXES) -> dict[str, float]:
    """Sum of every sample of every metric with one of ``prefixes``, by normalised name.
    Histogram buckets and quantile series are skipped (their _sum/_count are kept)."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, value = _split_sample(line)
        if name is None or name.endswith("_bucket") or 'quantile="' in line:
            continue
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            continue
        key = name[len(prefix):]
        key = key[: -len("_total")] if key.endswith("_total") else key
        if math.isfinite(value):
            out[key] = out.get(key, 0.0) + value
    return out


def _split_sample(line: str) -> tuple[str | None, float]:
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        name, rest = line[:brace], line[close + 1:]
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    if not fields:
        return None, 0.0
    try:
        return name.strip(), float(fields[0])
    except ValueError:
        return None, 0.0


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` for numeric counters (a key missing before counts from 0)."""
    out: dict[str, float] = {}
    for key, value in after.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        prev = before.get(key, 0.0)
        prev = prev if isinstance(prev, (int, float)) else 0.0
        out[key] = value - prev
    return out


def dvr_summary(delta: Mapping[str, float], output_tokens: int) -> dict[str, float]:
    """The decode-verify-rollback counters of one run plus the recompute percentage:
    recomputed tokens over committed tokens (over output tokens when the server does not
    report committed tokens), as in the paper's Table 4."""
    out = {k: float(delta[k]) for k in DVR_KEYS if k in delta}
    base = out.get("committed_tokens") or float(output_tokens)
    if "recomputed_tokens" in out and base > 0:
        out["recompute_pct"] = 100.0 * out["recomputed_tokens"] / base
    return out
