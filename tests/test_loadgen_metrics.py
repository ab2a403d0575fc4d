"""Metric computation on synthetic timings (vLLM definitions and keys), the stream
recorder, and server counters (Prometheus parsing, deltas, rollback summary)."""

from __future__ import annotations

import json

import pytest

from loadgen import targets
from loadgen.metrics import compute_metrics, format_metrics, percentile_key, split_metrics
from loadgen.runner import jsonable
from loadgen.server_stats import counter_delta, dvr_summary, parse_prometheus
from loadgen.targets.base import RequestResult, ResultRecorder
from loadgen.trace import TraceRequest


def _res(rid: str, *, det: bool = False, prompt: int = 10, out: int = 5, ttft: float = 0.1,
         e2el: float = 0.5, itl: list[float] | None = None, ok: bool = True) -> RequestResult:
    return RequestResult(rid, det, prompt, success=ok, error="" if ok else "boom",
                         output_len=out if ok else 0, ttft_s=ttft, e2el_s=e2el,
                         itl_s=itl if itl is not None else [0.1] * (out - 1))


def test_metrics_on_synthetic_timings() -> None:
    results = [
        _res("a", ttft=0.1, e2el=0.5, out=5, itl=[0.1, 0.1, 0.1, 0.1]),
        _res("b", ttft=0.3, e2el=1.3, out=11, itl=[0.1] * 10, det=True),
        _res("c", ttft=0.2, e2el=0.2, out=1, itl=[]),                    # no TPOT
        _res("d", ok=False, ttft=9, e2el=9),
    ]
    m = compute_metrics(results, duration_s=2.0, percentiles=(50, 90, 99.5))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 17
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(8.5)
    assert m["total_token_throughput"] == pytest.approx(23.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)                # linear interpolation
    assert m["std_ttft_ms"] == pytest.approx(81.6496580927726)
    # TPOT: (e2el - ttft) / (out - 1) = 100 ms for a and b; c has a single token
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0) and m["p99.5_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx((500 + 1300 + 200) / 3)
    assert percentile_key("ttft", 99.5) == "p99.5_ttft_ms" and "p99.5_ttft_ms" in m


def test_metrics_empty_and_zero_duration() -> None:
    m = compute_metrics([], duration_s=0.0)
    assert m["completed"] == 0 and m["request_throughput"] == 0.0 and m["mean_ttft_ms"] == 0.0
    json.dumps(m, allow_nan=False)


def test_split_by_determinism() -> None:
    results = [_res("a", ttft=0.1), _res("b", det=True, ttft=0.5), _res("c", det=True, ttft=0.7)]
    m = split_metrics(results, 1.0)
    assert m["num_deterministic"] == 2
    assert m["deterministic"]["completed"] == 2
    assert m["deterministic"]["mean_ttft_ms"] == pytest.approx(600.0)
    assert m["non_deterministic"]["mean_ttft_ms"] == pytest.approx(100.0)
    text = format_metrics({**m, "server_stats": {"rollbacks": 3.0, "recompute_pct": 1.5}})
    assert "Serving Benchmark Result" in text and "Mean TTFT (ms):" in text
    assert "P99 E2EL (ms):" in text and "deterministic requests" in text and "rollbacks:" in text


def test_recorder_measures_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 10.5, 10.7, 10.75, 11.0])
    monkeypatch.setattr("loadgen.targets.base.time.perf_counter", lambda: next(clock))
    rec = ResultRecorder(TraceRequest("r", "p", 3, 8, is_deterministic=True), run_start=9.0)
    rec.chunk("ab", num_tokens=2)        # t=10.5: first chunk carries a 2-token window
    rec.chunk("", num_tokens=0)          # ignored: carries nothing
    rec.chunk("c", logprobs=[-0.1])      # t=10.7
    rec.chunk("def", token_ids=[1, 2, 3])  # t=10.75
    res = rec.finish(finish_reason="length")     # t=11.0
    assert res.start_s == pytest.approx(1.0)
    assert res.ttft_s == pytest.approx(0.5) and res.e2el_s == pytest.approx(1.0)
    assert res.itl_s == pytest.approx([0.2, 0.05])
    assert res.chunk_tokens == [2, 1, 3] and res.output_len == 6
    assert res.text == "abcdef" and res.token_ids == [1, 2, 3] and res.logprobs == [-0.1]
    assert res.tpot_s == pytest.approx(0.5 / 5)
    assert res.success and res.is_deterministic


def test_recorder_failure_and_empty_stream() -> None:
    rec = ResultRecorder(TraceRequest("r", "p", 3, 8), 0.0)
    assert rec.finish().success is False
    rec = ResultRecorder(TraceRequest("r", "p", 3, 8), 0.0)
    res = rec.fail("HTTP 500")
    assert not res.success and res.error == "HTTP 500" and res.tpot_s is None


def test_result_json_roundtrip() -> None:
    r = _res("a", det=True)
    assert RequestResult.from_json(json.loads(json.dumps(r.to_json()))) == r
    assert targets.RequestResult is RequestResult


PROM = """\
# HELP detserve:rollbacks_total Windows with a rejected candidate.
# TYPE detserve:rollbacks_total counter
detserve:rollbacks_total{replica="0"} 3
detserve:rollbacks_total{replica="1"} 4
detserve:recomputed_tokens_total 120
detserve:verify_passes_total 50.0
detserve:committed_tokens_total 1000
detserve:e2e_latency_seconds_bucket{le="0.1"} 7
detserve:e2e_latency_seconds_sum 12.5
detserve:e2e_latency_seconds_count 30
detserve:quantiles{quantile="0.5"} 1
vllm:num_requests_running 2
other_metric_total 99
"""


def test_parse_prometheus_normalises_names() -> None:
    s = parse_prometheus(PROM)
    assert s["rollbacks"] == 7 and s["recomputed_tokens"] == 120 and s["verify_passes"] == 50
    assert s["e2e_latency_seconds_sum"] == 12.5 and "e2e_latency_seconds_bucket" not in s
    assert s["num_requests_running"] == 2
    assert "quantiles" not in s and "other_metric" not in s


def test_counter_delta_and_dvr_summary() -> None:
    before = {"rollbacks": 2.0, "recomputed_tokens": 20.0, "committed_tokens": 500.0}
    after = parse_prometheus(PROM)
    d = counter_delta(before, after)
    assert d["rollbacks"] == 5 and d["recomputed_tokens"] == 100 and d["verify_passes"] == 50
    s = dvr_summary(d, output_tokens=400)
    assert s["recompute_pct"] == pytest.approx(100 * 100 / 500)
    s = dvr_summary({"recomputed_tokens": 10.0}, output_tokens=400)
    assert s["recompute_pct"] == pytest.approx(2.5)
    assert dvr_summary({}, 0) == {}


def test_jsonable_makes_strict_json() -> None:
    d = jsonable({"qps": float("inf"), "xs": [1.0, float("nan")], "t": (1, 2)})
    assert json.loads(json.dumps(d, allow_nan=False)) == {"qps": "inf", "xs": [1.0, "nan"],
                                                          "t": [1, 2]}
