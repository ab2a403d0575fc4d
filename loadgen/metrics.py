"""Benchmark metrics with vLLM's definitions, key names and printed layout.

TTFT: send to first streamed token. TPOT: (E2EL - TTFT) / (output_len - 1) per request,
for requests with at least 2 output tokens. ITL: gaps between streamed chunks, over all
requests. E2EL: send to last token. Throughputs divide by the run's wall duration. Keys
follow vLLM's result JSON (``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``,
``p99_ttft_ms``...), and the same scalars are given again for the deterministic and the
non-deterministic requests of the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadgen.stats import mean, median, percentile, std
from loadgen.targets.base import RequestResult

DEFAULT_PERCENTILES: tuple[float, ...] = (50, 75, 90, 99)
LATENCIES = (("ttft", "TTFT", "Time to First Token"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"))


def percentile_key(metric: str, p: float) -> str:
    p_str = str(int(p)) if int(p) == p else str(p)
    return f"p{p_str}_{metric}_ms"


def latency_samples_ms(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft_s * 1000.0 for r in ok],
        "tpot": [t * 1000.0 for r in ok if (t := r.tpot_s) is not None],
        "itl": [x * 1000.0 for r in ok for x in r.itl_s],
        "e2el": [r.e2el_s * 1000.0 for r in ok],
    }


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM's scalar metrics of ``results`` over a run of ``duration_s`` seconds."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    for name, xs in latency_samples_ms(results).items():
        out[f"mean_{name}_ms"] = mean(xs)
        out[f"median_{name}_ms"] = median(xs)
        out[f"std_{name}_ms"] = std(xs)
        for p in percentiles:
            out[percentile_key(name, p)] = percentile(xs, p)
    return out


def split_metrics(results: Sequence[RequestResult], duration_s: float,
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """All-request metrics at the top level, plus ``deterministic`` and
    ``non_deterministic`` sub-dicts computed over the same duration."""
    out = compute_metrics(results, duration_s, percentiles)
    det = [r for r in results if r.is_deterministic]
    nondet = [r for r in results if not r.is_deterministic]
    out["num_deterministic"] = len(det)
    out["deterministic"] = compute_metrics(det, duration_s, percentiles)
    out["non_deterministic"] = compute_metrics(nondet, duration_s, percentiles)
    return out


def per_request_lists(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    """vLLM's per-request arrays (seconds), plus E2EL, the send offsets from the start of
    the run and the deterministic flag."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft_s for r in results],
        "itls": [r.itl_s for r in results],
        "e2els": [r.e2el_s for r in results],
        "starts": [r.start_s for r in results],
        "is_deterministic": [r.is_deterministic for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }


def format_metrics(m: dict[str, Any], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                   title: str = " Serving Benchmark Result ") -> str:
    lines = ["{s:{c}^{n}}".format(s=title, n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{label:<40} " + fmt.format(value))

    row("Successful requests:", m["completed"], "{:<10}")
    row("Failed requests:", m["failed"], "{:<10}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for key, short, header in LATENCIES:
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", m[f"median_{key}_ms"])
        for p in percentiles:
            k = percentile_key(key, p)
            if k in m and p != 50:
                row(f"P{k[1:].split('_')[0]} {short} (ms):", m[k])
    for part in ("deterministic", "non_deterministic"):
        sub = m.get(part)
        if sub and sub["completed"]:
            lines.append("{s:{c}^{n}}".format(s=f" {part.replace('_', '-')} requests ", n=50,
                                               c="-"))
            row("Successful requests:", sub["completed"], "{:<10}")
            row("Output token throughput (tok/s):", sub["output_throughput"])
            for key, short, _ in LATENCIES:
                row(f"Median {short} (ms):", sub[f"median_{key}_ms"])
                k = percentile_key(key, 99)
                if k in sub:
                    row(f"P99 {short} (ms):", sub[k])
    dvr = m.get("server_stats") or {}
    if dvr:
        lines.append("{s:{c}^{n}}".format(s=" Server (decode-verify-rollback) ", n=50, c="-"))
        for k, v in dvr.items():
            row(f"{k}:", v, "{:<10.2f}" if k.endswith("pct") else "{:<10.0f}")
    lines.append("=" * 50)
    return "\n".join(lines)
