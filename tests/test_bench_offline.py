"""The offline benchmark harness: repeated, interleaved runs and their medians."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_offline

# a tiny run of both modes at one ratio, one warm-up request
TINY = ["--model", "random:tiny", "--num-requests", "6", "--input-len", "12",
        "--output-len", "10", "--modes", "nondeterministic,llm42", "--ratios", "0.5",
        "--verify-window", "8", "--verify-group", "2", "--warmup-requests", "1"]


def test_repeated_runs_are_summarized_by_median(tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    assert bench_offline.main([*TINY, "--repeat", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    # interleaved: every mode once per repeat, in the order given
    assert [(r["mode"], r["repeat"]) for r in runs] == [
        ("nondeterministic", 0), ("llm42", 0), ("nondeterministic", 1), ("llm42", 1)]
    assert all(r["total_output_tokens"] == 60 for r in runs)
    det = [r for r in runs if r["mode"] == "llm42"]
    assert all(r["windows"] > 0 and r["verify_passes"] > 0 for r in det)
    assert all(r["last_finish_s"]["deterministic"] is not None for r in det)
    summary = {s["mode"]: s for s in report["summary"]}
    for mode in ("nondeterministic", "llm42"):
        tps = sorted(r["output_throughput"] for r in runs if r["mode"] == mode)
        s = summary[mode]
        assert s["runs"] == 2 and s["min"] == tps[0] and s["max"] == tps[1]
        assert s["median_output_throughput"] == (tps[0] + tps[1]) / 2
    base = summary["nondeterministic"]["median_output_throughput"]
    assert summary["llm42"]["vs_nondeterministic_median"] == (
        summary["llm42"]["median_output_throughput"] / base)
    md = out.with_suffix(".md").read_text()
    assert "Medians over the repeated runs" in md and "--repeat 2" in md


def test_a_run_past_its_deadline_stops_and_says_so(tmp_path: Path) -> None:
    """``--run-seconds``: a run is cut at its deadline (its unfinished requests aborted,
    none counted) and reports how many finished; without one every request finishes."""
    out = tmp_path / "offline.json"
    long = ["--num-requests", "8", "--output-len", "300", "--max-model-len", "512"]
    assert bench_offline.main([*TINY, *long, "--run-seconds", "0.2", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert all(r["stopped_s"] is not None and r["finished_requests"] < 8 for r in runs)
    assert all(r["total_output_tokens"] == 300 * r["finished_requests"] for r in runs)
    assert bench_offline.main([*TINY, "--out", str(out)]) == 0
    assert all(r["stopped_s"] is None and r["finished_requests"] == 6
               for r in json.loads(out.read_text())["runs"])


def test_llm42_variants_run_with_their_flags_and_are_summarized_apart(tmp_path: Path) -> None:
    out = tmp_path / "variants.json"
    assert bench_offline.main([
        *TINY, "--variants", "lane_max_wait_steps=2;lane_max_wait_steps=16,cuda_graph_step_rows=0",
        "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    llm42 = [r for r in report["runs"] if r["mode"] == "llm42"]
    assert [r["lane_max_wait_steps"] for r in llm42] == [2, 16]
    assert [r["variant"] for r in llm42] == [
        "lane_max_wait_steps=2", "lane_max_wait_steps=16,cuda_graph_step_rows=0"]
    assert all(r["mean_first_token_s"]["deterministic"] is not None for r in llm42)
    assert len(report["summary"]) == 3  # nondeterministic + one row per variant
    assert "'lane_max_wait_steps=2;" in out.with_suffix(".md").read_text()  # quoted for a shell
    base = argparse.Namespace(
        variants="cuda_graphs=1,lane_sms=32,async_scheduling=0;cuda_graphs=off,"
                 "lane_max_wait_steps=4,aligned_decode_lane=16:1:2",
        cuda_graphs=False, lane_sms=None, lane_max_wait_steps=8, async_scheduling=None,
        aligned_decode_lane="auto", out=None)
    parsed = [(v.cuda_graphs, v.lane_sms, v.lane_max_wait_steps, v.async_scheduling,
               v.aligned_decode_lane) for v in bench_offline.parse_variants(base)]
    # values as the options declare them (lane_sms an int, async_scheduling a bool)
    assert parsed == [(True, 32, 8, False, "auto"), (False, None, 4, None, "16:1:2")]
    for bad in ("no_such_flag=1", "lane_max_wait_steps", "variants=x", "lane_max_wait_steps=x"):
        with pytest.raises(SystemExit, match="--variants"):
            bench_offline.main(["--model", "random:tiny", "--num-requests", "1", "--variants", bad])


def test_mixed_step_benchmark_times_the_four_variants(tmp_path: Path) -> None:
    """bench_mixed_step on CPU: one fixed mixed batch (decode rows + a prefill chunk) per
    variant, each timed, the first the baseline; the batch's tables stay disjoint."""
    from benchmarks import bench_mixed_step

    segs, specs, blocks = bench_mixed_step.mixed_batch(5, 40, 24, 16, 100)
    assert [len(s.input_ids) for s in segs] == [1] * 5 + [24] and len(specs) == 6
    used = [b for s in segs for b in s.block_table]
    assert len(used) == len(set(used)) == blocks and max(used) == blocks - 1
    assert all(s.start == 40 for s in segs[:5]) and segs[5].start == 0
    out = tmp_path / "mixed.json"
    assert bench_mixed_step.main([
        "--model", "random:tiny", "--device", "cpu", "--dtype", "float32",
        "--decode-rows", "6", "--context", "40", "--prefill-tokens", "24", "--steps", "2",
        "--verify-window", "8", "--verify-group", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["align_decode"]) for r in rows] == [
        ("nondeterministic", False), ("llm42", False), ("llm42", True), ("llm42", True)]
    assert all(r["step_ms"] > 0 for r in rows) and rows[0]["vs_nondeterministic"] == 1.0
    # on CPU there is no alignment, so no product is probed and none runs unsplit
    assert all(r["step_rows"] == 30 and r["unsplit_products"] == [] for r in rows)


def test_stream_summary_counts_each_stream_once_and_the_overlap_between_them() -> None:
    from benchmarks.stream_profile import Kernel, stream_summary, union_us

    assert union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert union_us([]) == 0
    kernels = [Kernel(7, "gemm", 0, 4000), Kernel(7, "attn", 3000, 6000),  # 6 ms busy
               Kernel(9, "lane_gemm", 5000, 9000)]  # 4 ms, 1 of them beside stream 7
    s = stream_summary(kernels, steps=2)
    assert [x["stream"] for x in s["streams"]] == [7, 9]  # busiest first
    fast, lane = s["streams"]
    assert fast["busy_ms_per_step"] == 3.0 and fast["kernel_ms_per_step"] == 3.5
    assert lane["busy_ms_per_step"] == 2.0
    assert s["gpu_busy_ms_per_step"] == 4.5 and s["overlap_ms_per_step"] == 0.5
    assert s["window_ms_per_step"] == 4.5
    assert fast["top_kernels"][0] == {"name": "gemm", "ms_per_step": 2.0}


def test_stream_summary_keeps_apart_kernels_whose_names_differ_late() -> None:
    from benchmarks.stream_profile import Kernel, stream_summary

    # ATen's elementwise kernels share a long prefix and differ in the functor named after it
    stem = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<" * 2
    kernels = [Kernel(7, stem + "silu_kernel>", 0, 1000), Kernel(7, stem + "silu_kernel>", 1000, 2000),
               Kernel(7, stem + "direct_copy_kernel>", 2000, 5000)]
    tops = stream_summary(kernels, steps=1)["streams"][0]["top_kernels"]
    assert [(t["name"][len(stem):], t["ms_per_step"]) for t in tops] == [
        ("direct_copy_kernel>", 3.0), ("silu_kernel>", 2.0)]


def test_profile_steps_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("5", "3:3", "x:4", "-1:2"):
        with pytest.raises(SystemExit):
            bench_offline.main([*TINY, "--device", "cuda", "--profile-steps", bad])
        assert "--profile-steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a CPU run has no CUDA kernels to report
        bench_offline.main([*TINY, "--profile-steps", "1:3"])
    assert "needs --device cuda" in capsys.readouterr().err
    assert bench_offline.profile_range("2:6") == (2, 6)


def test_a_bad_aligned_decode_lane_is_refused_before_any_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_offline.main([*TINY, "--variants", ";aligned_decode_lane=16:3:2"])
    assert "--aligned-decode-lane" in capsys.readouterr().err


def test_dedicated_verifier_mode_transfers_and_audits(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """``llm42-dedicated``: a verifier replica process registered as another host (CPU:
    gloo) verifies; its runs report the K/V moved and give the deterministic requests the
    co-located lane's outputs (the audit line), with the fast path perturbed."""
    out = tmp_path / "dedicated.json"
    args = [*TINY, "--modes", "llm42,llm42-dedicated", "--ratios", "0.5,1.0",
            "--dedicated-verifier-device", "cpu",
            "--fastpath-perturbation", "0.2", "--logprobs", "1", "--temperature", "0.7",
            "--out", str(out)]
    assert bench_offline.main(args) == 0
    runs = json.loads(out.read_text())["runs"]
    dedicated = [r for r in runs if r["mode"] == "llm42-dedicated"]
    assert len(dedicated) == 2
    for r in dedicated:
        t = r["transfer"]
        assert t["pulled_rows"] > 0 and t["verifier_passes"] == r["verify_passes"]
        assert r["rollbacks"] > 0, "the fast path was perturbed"
    for ratio in (0.5, 1.0):
        pair = [r["det_digests"] for r in runs if r["deterministic_ratio"] == ratio]
        assert len(pair) == 2 and pair[0] == pair[1] and pair[0]
    assert "0 with more" in capsys.readouterr().out


@pytest.mark.parametrize("verifier_tp", [1, 2])
def test_dedicated_verifier_mode_at_tp2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       verifier_tp: int) -> None:
    """``llm42-dedicated`` with a TP=2 decoder (the invariant lane): the replica (at TP=1,
    or itself at TP=2) verifies, rows move to and from both ranks, and the deterministic
    outputs equal those of the TP=2 engine's own lane."""
    out = tmp_path / "dedicated-tp2.json"
    args = [*TINY, "--modes", "llm42,llm42-dedicated", "--ratios", "1.0",
            "--dedicated-verifier-device", "cpu", "--dedicated-verifier-tp", str(verifier_tp),
            "--tensor-parallel-size", "2",
            "--tp-invariant-lane", "--fastpath-perturbation", "0.2", "--logprobs", "1",
            "--temperature", "0.7", "--out", str(out)]
    assert bench_offline.main(args) == 0
    runs = json.loads(out.read_text())["runs"]
    (dedicated,) = [r for r in runs if r["mode"] == "llm42-dedicated"]
    assert dedicated["transfer"]["pulled_rows"] > 0 and dedicated["rollbacks"] > 0
    pair = [r["det_digests"] for r in runs]
    assert len(pair) == 2 and pair[0] == pair[1] and pair[0]
    assert "0 with more" in capsys.readouterr().out


def test_kv_pull_check_counts_the_pulled_window_rows(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU diagnostic runs end to end on CPU: it sees window rows pulled from a
    dedicated verifier, and every row it wrote reads back (its counts come from real
    pulls, not a stale API)."""
    from benchmarks import kv_pull_check
    from services.verifier.transfer import DecoderTransfer

    # the diagnostic wraps these two; put them back afterwards
    monkeypatch.setattr(bench_offline, "run_one", bench_offline.run_one)
    monkeypatch.setattr(DecoderTransfer, "pull", DecoderTransfer.pull)
    args = [*TINY, "--modes", "llm42-dedicated", "--ratios", "1.0",
            "--dedicated-verifier-device", "cpu"]
    assert kv_pull_check.main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "pulled window rows" in x)
    total = int(line.split("fast path's: ")[1].split(" of ")[1].split()[0])
    assert total > 0 and line.endswith("rows that did not land: 0")


def test_audit_compares_lane_runs_and_batch_invariant_runs_apart() -> None:
    """batch_invariant's kernels have other bits than the lane's: its runs are audited
    among themselves, and a lane run that disagrees with another lane run is still
    caught."""
    lane = {"mode": "llm42", "det_digests": {"a": "1", "b": "2"}}
    bi = {"mode": "batch_invariant", "det_digests": {"a": "9", "b": "8"}}
    lines = bench_offline.audit_lines([lane, dict(lane), bi, dict(bi)])
    assert lines == [
        "determinism audit: 2 deterministic requests over 2 runs: 2 with one output, 0 with more",
        "determinism audit, batch_invariant: 2 deterministic requests over 2 runs: "
        "2 with one output, 0 with more"]
    drift = {"mode": "llm42-dedicated", "det_digests": {"a": "1", "b": "3"}}
    assert "1 with more (b)" in bench_offline.audit_lines([lane, drift, bi])[0]


def test_compare_digests_audits_runs_across_files(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Two result files agree request by request, or name the requests whose outputs
    differ; ratios one file lacks and runs of other modes are left out."""
    from benchmarks import compare_digests

    def write(name: str, runs: list[dict[str, Any]]) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"runs": runs}))
        return path

    def run(ratio: float, digests: dict[str, str], mode: str = "llm42") -> dict[str, Any]:
        return {"mode": mode, "deterministic_ratio": ratio, "det_digests": digests}

    a = write("a.json", [run(0.1, {"b0": "x"}), run(1.0, {"b0": "x", "b1": "y"}),
                         run(0.5, {"b0": "x"}), run(1.0, {"b0": "z"}, "batch_invariant")])
    b = write("b.json", [run(0.1, {"b0": "x"}), run(1.0, {"b0": "x", "b1": "w"})])
    lines = compare_digests.compare([a, b])
    assert lines == [
        "llm42 at 10%: determinism audit: 1 deterministic requests over 2 runs: "
        "1 with one output, 0 with more",
        "llm42 at 100%: determinism audit: 2 deterministic requests over 2 runs: "
        "1 with one output, 1 with more (b1)"]
    assert compare_digests.main([str(a), str(b)]) == 0
    assert "1 with more (b1)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compare_digests.main([str(a), str(b), "--mode", "nondeterministic"])
