"""Replay a trace against a target and produce one run's result (vLLM-style JSON).

The run reads the server's counters before and after, so its result carries the
rollback/recompute/verify statistics of exactly this run next to the client metrics.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loadgen.metrics import DEFAULT_PERCENTILES, per_request_lists, split_metrics
from loadgen.server_stats import counter_delta, dvr_summary
from loadgen.targets.base import ReplayOptions, RequestResult, Target
from loadgen.trace import Trace


@dataclass(frozen=True)
class RunConfig:
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    progress: bool = True
    keep_texts: bool = True
    deadline_s: float | None = None   # see ReplayOptions


async def run_benchmark(target: Target, trace: Trace, cfg: RunConfig | None = None,
                        **labels: Any) -> tuple[dict[str, Any], list[RequestResult]]:
    """Replay ``trace`` on ``target``; returns (result JSON dict, per-request results).
    ``labels`` (mode, ratio, qps, dataset...) are stored in the result as given."""
    cfg = cfg or RunConfig()
    before = await target.server_stats()
    bar = progress_bar(len(trace), str(labels.get("name", target.label)), cfg.progress)
    opts = ReplayOptions(cfg.max_concurrency, cfg.request_timeout_s, cfg.deadline_s)
    start = time.perf_counter()
    try:
        results = await target.replay(trace.requests, opts, on_done=lambda _r: bar.update(1))
    finally:
        bar.close()
    duration = time.perf_counter() - start
    after = await target.server_stats()
    delta = counter_delta(before, after)

    out: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "target": target.label,
        "num_prompts": len(trace),
        "request_rate": _qps(trace),
        "burstiness": trace.meta.get("traffic", {}).get("burstiness"),
        "max_concurrency": cfg.max_concurrency,
        "host": platform.node(),
        "labels": labels,
        "trace_meta": trace.meta,
    }
    out.update(split_metrics(results, duration, cfg.percentiles))
    out["server_stats"] = dvr_summary(delta, out["total_output_tokens"])
    out["server_counters"] = delta
    out["determinism_profiles"] = _profiles(results)
    per_request = per_request_lists(results)
    if not cfg.keep_texts:
        per_request.pop("generated_texts")
    out.update(per_request)
    return out, results


def save_result(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(result), indent=1, default=str, allow_nan=False))
    return path


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats written as strings ("inf"), so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def _qps(trace: Trace) -> float | str:
    qps = trace.meta.get("traffic", {}).get("qps", "inf")
    return "inf" if qps in ("inf", None) or (isinstance(qps, float) and math.isinf(qps)) \
        else qps


def _profiles(results: list[RequestResult]) -> list[Any]:
    """Distinct determinism objects the server attached (normally one per server)."""
    seen: list[Any] = []
    for r in results:
        d = r.determinism
        prof = d.get("fingerprint", d) if isinstance(d, dict) else None
        if prof is not None and prof not in seen:
            seen.append(prof)
    return seen


class _NoBar:
    def update(self, n: int = 1) -> None:
        return None

    def close(self) -> None:
        return None


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)
