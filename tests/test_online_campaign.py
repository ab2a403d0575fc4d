"""The online campaign's pure parts (issue 37): the budget planner, the keep-up ratio and
saturation, the latency targets, the report, the served audit's rounds and verdicts, and
the cross-GPU comparer; a served audit against the toy server; and (slow) the driver
against a real `detserve serve --device cpu`."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from fake_openai_server import running_server

from benchmarks import det_outputs, online_campaign, served_audit
from benchmarks.campaign.analysis import (
    e2e_checks,
    keep_up_ratio,
    keeps_up,
    saturation,
    ttft_checks,
)
from benchmarks.campaign.plan import (
    CampaignPlan,
    DatasetPlan,
    Series,
    TimeModel,
    budget_cells,
    estimate,
    num_requests,
)
from benchmarks.campaign.report import analyse, build_report
from loadgen.audit_prompts import AuditConfig, AuditPlan
from loadgen.targets.base import RequestResult
from loadgen.targets.openai_http import OpenAIHTTPTarget
from loadgen.tokenizer import ByteTokenizer

TM = TimeModel(start_s=50.0, stop_s=10.0, probe_s=20.0, min_window_s=8.0, max_window_s=60.0)


def _plan(series: str = "nondeterministic@0,llm42@0.1,batch_invariant@1",
          datasets: tuple[tuple[str, float], ...] = (("sharegpt", 15.0), ("arxiv-like", 20.0)),
          **kw: Any) -> CampaignPlan:
    return CampaignPlan(tuple(DatasetPlan(n, f"{n}.jsonl", d) for n, d in datasets),
                        tuple(Series.parse(s) for s in series.split(",")), **kw)


# ---- plan ------------------------------------------------------------------------------
def test_series_parse_and_bad_input() -> None:
    s = Series.parse("llm42@0.1")
    assert (s.server, s.ratio, s.name) == ("llm42", 0.1, "llm42@0.1")
    for bad in ("llm42", "nosuch@0.1", "llm42@1.5"):
        with pytest.raises(ValueError):
            Series.parse(bad)
    with pytest.raises(ValueError, match="not a dataset"):
        _plan(rates={"other": (1.0,)})


def test_budget_window_fits_and_every_run_gets_it() -> None:
    plan = _plan()
    b = budget_cells(plan, 1200.0, TM)
    assert len(b.cells) == 2 * 3 * 3 and not b.cuts
    # 3 servers (start + stop), 2 probes, 18 runs of window + drain
    fixed = 3 * 60.0 + 2 * 20.0
    drains = 9 * 15.0 + 9 * 20.0
    assert b.window_s == pytest.approx((1200.0 - fixed - drains) / 18)
    assert b.estimate_s == pytest.approx(1200.0)
    assert estimate(plan, b.cells, b.window_s, TM) <= 1200.0 + 1e-9


def test_budget_cuts_from_the_end_of_the_priority_order() -> None:
    plan = _plan()
    b = budget_cells(plan, 480.0, TM)
    kept = [c.key for c in b.cells]
    assert b.window_s >= TM.min_window_s and b.estimate_s <= 480.0 + 1e-9
    assert b.cuts and all("no room" in c for c in b.cuts)
    # the first dataset's first series is kept whole; the cut runs are the last ones
    assert kept[:3] == ["sharegpt/nondeterministic@0/0", "sharegpt/nondeterministic@0/1",
                        "sharegpt/nondeterministic@0/2"]
    order = [c.key for c in plan.cells()]
    assert order[:len(kept)] == kept
    assert [c.split(":")[0] for c in b.cuts] == list(reversed(order[len(kept):]))
    # a budget that holds less than one server start fails clearly
    with pytest.raises(ValueError, match="not even one run"):
        budget_cells(plan, 50.0, TM)


def test_explicit_rates_need_no_probe_and_fractions_need_a_capacity() -> None:
    plan = _plan(rates={"sharegpt": (2.0, 4.0)})
    assert not plan.needs_probe("sharegpt") and plan.needs_probe("arxiv-like")
    assert plan.points("sharegpt") == 2 and plan.points("arxiv-like") == 3
    assert plan.rate("sharegpt", 1, None) == 4.0
    assert plan.rate("arxiv-like", 1, 10.0) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="no capacity"):
        plan.rate("arxiv-like", 0, None)
    assert num_requests(0.5, 10.0, TM, 100) == TM.min_requests
    assert num_requests(20.0, 10.0, TM, 100) == 100
    assert num_requests(3.0, 10.0, TM, 1000) == 30


# ---- keep-up and saturation ----------------------------------------------------------
def _run(dataset: str, series: str, rate: float, *, n: int = 200, service: float = 2.0,
         capacity: float | None = None, failed: int = 0, seed: int = 0,
         p99: dict[str, float] | None = None, det_ttft: float | None = None,
         nondet_ttft: float | None = None) -> dict[str, Any]:
    """A run of Poisson arrivals at ``rate`` whose E2E is ``service`` seconds, plus the
    backlog of a fluid queue when ``capacity`` < rate (a request arriving at t waits
    (rate / capacity - 1) t more)."""
    rng = random.Random(seed)
    t, starts, e2els = 0.0, [], []
    for _ in range(n):
        starts.append(t)
        extra = (rate / capacity - 1.0) * t if capacity and rate > capacity else 0.0
        e2els.append(service * rng.uniform(0.5, 1.5) + extra)
        t += rng.expovariate(rate)
    server, _, ratio = series.partition("@")
    run: dict[str, Any] = {
        "labels": {"dataset": dataset, "series": series, "server": server, "qps": rate,
                   "ratio": float(ratio), "mode": server.split("-")[0]},
        "starts": starts, "e2els": e2els, "errors": ["x"] * failed + [""] * (n - failed),
        "completed": n - failed, "failed": failed, "num_prompts": n,
        "output_throughput": 100.0 * rate}
    for k, v in (p99 or {}).items():
        run[f"p99_{k}_ms"] = v
    for part, v in (("deterministic", det_ttft), ("non_deterministic", nondet_ttft)):
        run[part] = {"completed": 5, "p99_ttft_ms": v} if v is not None else {"completed": 0}
    return run


def test_keep_up_ratio_is_one_when_kept_up_and_capacity_over_rate_when_not() -> None:
    ok = _run("d", "nondeterministic@0", 10.0)
    assert keep_up_ratio(ok["starts"], ok["e2els"]) == pytest.approx(1.0, abs=0.1)
    over = _run("d", "nondeterministic@0", 10.0, capacity=5.0)
    assert keep_up_ratio(over["starts"], over["e2els"]) == pytest.approx(0.5, abs=0.05)
    assert keeps_up(ok).kept_up and not keeps_up(over).kept_up
    failed = keeps_up(_run("d", "nondeterministic@0", 10.0, failed=1))
    assert not failed.kept_up and "failed" in failed.why
    assert keep_up_ratio([0.0, 1.0], [1.0, 1.0]) is None
    with pytest.raises(ValueError):
        keep_up_ratio([0.0], [])


def test_saturation_is_the_highest_rate_below_the_first_failure() -> None:
    runs = [_run("d", "nondeterministic@0", r, capacity=13.0) for r in (4.0, 8.0, 12.0, 16.0)]
    runs.append(_run("d", "nondeterministic@0", 20.0, capacity=30.0))  # after a failure
    sat = saturation(runs, "d", "nondeterministic@0")
    assert sat is not None and sat.rate == 12.0 and sat.reached
    assert sat.kept_up == (True, True, True, False, True)
    never = saturation([_run("d", "x@0", r) for r in (1.0, 2.0)], "d", "x@0")
    assert never is not None and never.rate == 2.0 and not never.reached
    assert "not reached" in never.describe()
    low = saturation([_run("d", "x@0", 9.0, capacity=3.0)], "d", "x@0")
    assert low is not None and low.rate is None and low.describe().startswith("< 9")
    assert saturation(runs, "d", "other@0") is None


def test_e2e_target_checks_rates_up_to_80_percent_of_saturation_and_reports_misses() -> None:
    base = [_run("d", "nondeterministic@0", r, capacity=9.0, p99={"e2el": 1000.0})
            for r in (4.0, 6.0, 8.0, 12.0)]
    ours = [_run("d", "llm42@0.1", 4.0, p99={"e2el": 1030.0}),
            _run("d", "llm42@0.1", 6.0, p99={"e2el": 1100.0}),
            _run("d", "llm42@0.1", 8.0, p99={"e2el": 3000.0})]  # above 0.8 x 8: not checked
    checks, note = e2e_checks(base + ours, "d")
    assert [c.rate for c in checks] == [4.0, 6.0]
    assert checks[0].passed and checks[0].value == pytest.approx(1.03)
    assert not checks[1].passed and checks[1].value == pytest.approx(1.1)
    assert "6.4 req/s" in note and "saturation rate 8 req/s" in note
    none, why = e2e_checks(ours, "d")
    assert not none and "no nondeterministic@0 runs" in why


def test_a_target_without_a_run_to_check_is_not_checked_rather_than_met() -> None:
    # nondeterministic keeps up only at 4 req/s: 80 % of it holds no llm42 run
    runs = [_run("d", "nondeterministic@0", 4.0, p99={"e2el": 1000.0}),
            _run("d", "nondeterministic@0", 8.0, capacity=5.0, p99={"e2el": 9000.0}),
            _run("d", "llm42@0.1", 4.0, p99={"e2el": 1000.0})]
    result = analyse(runs)
    assert result["e2e_target"] == "not checked" and result["ttft_target"] == "not checked"
    assert "no rate of both" in result["e2e_notes"][0]


def test_ttft_target_compares_deterministic_with_non_deterministic_in_the_same_run() -> None:
    runs = [_run("d", "llm42@0.1", 4.0, det_ttft=110.0, nondet_ttft=100.0),
            _run("d", "llm42@0.5", 4.0, det_ttft=130.0, nondet_ttft=100.0),
            _run("d", "nondeterministic@0", 4.0, nondet_ttft=100.0)]
    checks = ttft_checks(runs)
    assert [(c.series, c.passed) for c in checks] == [("llm42@0.1", True), ("llm42@0.5", False)]
    assert checks[1].value == pytest.approx(1.3)


def test_report_shows_saturation_figures_and_every_miss(tmp_path: Path) -> None:
    runs = []
    for rate in (4.0, 8.0, 12.0):
        for series, e2e in (("nondeterministic@0", 1000.0), ("llm42@0.1", 1200.0)):
            r = _run("sharegpt", series, rate, capacity=10.0, seed=int(rate),
                     p99={"e2el": e2e, "ttft": 50.0},
                     det_ttft=200.0 if series != "nondeterministic@0" else None,
                     nondet_ttft=100.0)
            runs.append(r)
    meta = {"date": "2026-11-27", "hardware": "test", "command": "x", "budget_s": 480,
            "budget": {"window_s": 10.0, "estimate_s": 470.0, "cuts": ["a/b/0: no room"]},
            "skipped": ["sharegpt/llm42@0.1/3: past saturation"]}
    path = build_report(runs, meta, tmp_path)
    text = path.read_text()
    assert "**MISS**" in text and "a/b/0: no room" in text
    assert "past saturation" in text and "Table 5 analogue" in text
    assert "8 req/s" in text   # nondeterministic's saturation rate
    result = json.loads((tmp_path / "analysis.json").read_text())
    assert result == json.loads(json.dumps(analyse(runs)))
    assert result["e2e_target"] == "missed" and result["ttft_target"] == "missed"
    assert "**MISSED**" in text
    assert (tmp_path / "plots" / "sharegpt" / "table5_ttft.md").exists()


# ---- driver helpers ------------------------------------------------------------------
def test_rates_flag_burst_rate_and_prepare(tmp_path: Path) -> None:
    assert online_campaign.parse_rates("sharegpt=4,8; arxiv-like=0.5") == {
        "sharegpt": (4.0, 8.0), "arxiv-like": (0.5,)}
    with pytest.raises(ValueError):
        online_campaign.parse_rates("sharegpt")
    # 41 completions 0.1 s apart: 10 per second, ramp and drain outside the middle half
    done = [0.1 * i for i in range(41)]
    assert online_campaign.burst_rate([0.0] * 41, done, [""] * 41) == pytest.approx(10.0)
    assert online_campaign.burst_rate([0.0] * 3, [1.0] * 3, [""] * 3) == 0.0
    [path] = online_campaign.prepare(online_campaign.PROFILES["cpu-smoke"], tmp_path,
                                     ["random"])
    from loadgen.trace import load_trace

    trace = load_trace(path)
    assert len(trace) == 64
    assert all(r.ignore_eos and r.prompt_token_ids and not r.prompt for r in trace.requests)


# ---- served audit ----------------------------------------------------------------------
def _audit_plan() -> AuditPlan:
    return AuditPlan(AuditConfig(max_tokens=6, mixed_lens=(8, 24), prefix_lens=(1, 16)),
                     ByteTokenizer())


def test_audit_rounds_sample_every_target_at_least_runs_times_with_controls() -> None:
    rounds = served_audit.audit_rounds(_audit_plan(), runs=5, max_batch=3)
    assert len(rounds) == 5
    counts: dict[str, int] = {}
    for batch in rounds:
        for r in batch:
            probe = str(r.tags["probe"])
            counts[probe] = counts.get(probe, 0) + 1
            assert r.is_deterministic == (not probe.startswith("control/"))
    targets = {p: n for p, n in counts.items() if not p.startswith("control/")}
    assert set(targets) == {"single", "mixed/len8", "mixed/len24", "prefix/prefix1",
                            "prefix/prefix16"}
    assert all(n >= 5 for n in targets.values())
    assert targets["single"] == 1 + 2 + 3 + 1 + 2
    assert all(counts["control/" + p] == n for p, n in targets.items())
    assert not any("control" in str(r.tags["probe"]) for b in
                   served_audit.audit_rounds(_audit_plan(), 2, 2, control=False) for r in b)


def _res(text: str, det: bool = True, ok: bool = True) -> RequestResult:
    return RequestResult("x", det, 3, success=ok, text=text, logprobs=[-1.0],
                         error="" if ok else "e")


def test_audit_verdict_needs_one_output_per_target_and_reports_control_drift() -> None:
    good = served_audit.summarize({"single": [_res("a"), _res("a")],
                                   "control/single": [_res("a", False), _res("b", False)]})
    assert good["passed"] and good["control_drift_seen"] and good["min_samples"] == 2
    bad = served_audit.summarize({"single": [_res("a"), _res("b")],
                                  "control/single": [_res("a", False)]})
    assert not bad["passed"] and not bad["control_drift_seen"]
    failed = served_audit.summarize({"single": [_res("a"), _res("a", ok=False)]})
    assert not failed["passed"] and failed["failed_requests"] == 1


@pytest.mark.parametrize("drift", [False, True])
def test_served_audit_against_the_toy_server(drift: bool) -> None:
    rounds = served_audit.audit_rounds(_audit_plan(), runs=4, max_batch=3)
    with running_server(FakeEngine(nondeterministic=drift, flip_at=1)) as url:
        async def go() -> dict[str, Any]:
            target = OpenAIHTTPTarget(url)
            try:
                by_probe, run = await served_audit.run_rounds(
                    target, rounds, ByteTokenizer(), in_flight=2, background_qps=50.0,
                    background_tokens=4)
            finally:
                await target.aclose()
            return {**served_audit.summarize(by_probe), "run": run}

        report = asyncio.run(go())
    assert report["failed_requests"] == 0 and report["run"]["background_failed"] == 0
    assert report["passed"] is not drift and report["control_drift_seen"] is drift
    assert report["min_samples"] >= 4 and report["run"]["rounds"] == 4


def test_served_audit_stops_starting_rounds_after_its_time() -> None:
    rounds = served_audit.audit_rounds(_audit_plan(), runs=3, max_batch=2)
    with running_server(FakeEngine()) as url:
        async def go() -> tuple[dict[str, Any], dict[str, Any]]:
            target = OpenAIHTTPTarget(url)
            try:
                return await served_audit.run_rounds(
                    target, rounds, ByteTokenizer(), in_flight=1, background_qps=0.0,
                    background_tokens=4, max_seconds=0.0)
            finally:
                await target.aclose()

        by_probe, run = asyncio.run(go())
    assert not by_probe and run["rounds"] == 0 and run["rounds_not_run"] == 3
    assert not served_audit.summarize(by_probe)["passed"]   # nothing audited: no pass


# ---- cross-GPU comparer ----------------------------------------------------------------
def _record(tokens: list[int], lps: list[str], device: str = "NVIDIA H100 80GB HBM3",
            fp: str = "aaaa") -> dict[str, Any]:
    return {"outputs": {"t0": {"token_ids": tokens, "logprobs": lps}},
            "digest": "d", "profile": {"fingerprint": fp, "device": device, "dtype": "bf16"},
            "environment": {"device": device, "sm_count": 132, "host": "h"}}


def test_cross_gpu_compare_per_request_and_profile_fields(tmp_path: Path) -> None:
    lp = [(-1.5).hex(), (-0.25).hex()]
    a = {"m|llm42": _record([5, 6], lp)}
    same = {"m|llm42": _record([5, 6], lp, device="NVIDIA H200", fp="bbbb")}
    v = det_outputs.compare_files(a, same)
    rec = v["records"]["m|llm42"]
    assert v["bitwise_equal"] and rec["requests"]["t0"]["first_logprob_diff"] is None
    assert rec["profile_diff"] == {"device": ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]}
    assert rec["environment_diff"] == {"device": ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]}
    lp_off = {"m|llm42": _record([5, 6], [lp[0], (-0.25000003).hex()])}
    rec = det_outputs.compare_files(a, lp_off)["records"]["m|llm42"]["requests"]["t0"]
    assert rec["tokens_equal"] and not rec["logprobs_equal"] and rec["first_logprob_diff"] == 1
    short = det_outputs.compare_files(a, {"m|llm42": _record([5], lp[:1])})
    assert not short["bitwise_equal"]
    assert short["records"]["m|llm42"]["requests"]["t0"]["first_token_diff"] == 1
    missing = det_outputs.compare_files(a, {"other|llm42": _record([5, 6], lp)})
    assert not missing["bitwise_equal"]
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(lp_off))
    assert det_outputs.compare(str(fa), str(fa), report=str(tmp_path / "r.json")) == 0
    assert json.loads((tmp_path / "r.json").read_text())["bitwise_equal"]
    assert det_outputs.compare(str(fa), str(fb)) == 1


# ---- the driver against a real server (CPU) --------------------------------------------
@pytest.mark.slow
def test_campaign_driver_against_detserve_serve_on_cpu(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    online_campaign.prepare(online_campaign.PROFILES["cpu-smoke"], traces, ["random"])
    out = tmp_path / "out"
    # the budget holds two of the three runs by the planner's estimate; the third runs
    # if the server started faster than estimated
    rc = online_campaign.main(["run", "--profile", "cpu-smoke", "--traces", str(traces),
                               "--series", "llm42@0.5", "--rates", "random=4,8,16",
                               "--budget-s", "55", "--out", str(out)])
    assert rc == 0
    meta = json.loads((out / "campaign.json").read_text())
    assert meta["servers"]["llm42"]["started"] and meta["elapsed_s"] < 55 + 15
    assert [c.split(":")[0] for c in meta["budget"]["cuts"]] == ["random/llm42@0.5/2"]
    runs = sorted((out / "runs").glob("*.json"))
    assert len(runs) == 2 + len(meta["extras_run"])
    for path in runs:
        run = json.loads(path.read_text())
        assert run["failed"] == 0 and run["completed"] == run["num_prompts"]
        assert run["deterministic"]["completed"] and run["non_deterministic"]["completed"]
        assert len(run["starts"]) == run["num_prompts"]
        assert run["labels"]["server"] == "llm42" and run["labels"]["ratio"] == 0.5
        assert run["server_counters"].get("verify_passes", 0) > 0   # the lane verified
    text = (out / "report.md").read_text()
    assert "Table 5 analogue" in text and "llm42@0.5" in text
