"""Figures, tables, the experiment matrix and the CLI, on synthetic results and a toy engine."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from fake_openai_server import running_server

from loadgen.cli import main
from loadgen.datasets import DatasetSpec
from loadgen.matrices import MATRICES, MatrixSpec, Workload, get_matrix
from loadgen.matrix import run_matrix
from loadgen.report import make_report
from loadgen.results import load_runs, series_name
from loadgen.tables import rollback_table, ttft_table
from loadgen.targets.engine import EngineTarget
from loadgen.tokenizer import ByteTokenizer


def _run(mode: str, ratio: float, qps: float | str, dataset: str, tput: float,
         e2els: list[float], rollbacks: float = 0.0) -> dict:
    return {"labels": {"mode": mode, "ratio": ratio, "qps": qps, "dataset": dataset},
            "completed": len(e2els), "total_token_throughput": tput, "e2els": e2els,
            "errors": [""] * len(e2els), "p50_ttft_ms": 10.0 * (1 + ratio),
            "p75_ttft_ms": 20.0, "p90_ttft_ms": 30.0,
            "server_stats": {"rollbacks": rollbacks, "recomputed_tokens": 8 * rollbacks,
                             "recompute_pct": 0.5 * rollbacks}}


RUNS = [
    _run("nondeterministic", 0.0, "inf", "ShareGPT", 1000, [1, 2]),
    _run("batch_invariant", 1.0, "inf", "ShareGPT", 700, [2, 3]),
    _run("llm42", 0.1, "inf", "ShareGPT", 950, [1, 2], rollbacks=2),
    _run("llm42", 1.0, "inf", "ShareGPT", 750, [2, 4], rollbacks=9),
    _run("llm42", 1.0, "inf", "ArXiv", 300, [5, 6], rollbacks=30),
    _run("nondeterministic", 0.0, 12.0, "ShareGPT", 10, [0.5, 1.0, 1.5]),
    _run("llm42", 0.5, 12.0, "ShareGPT", 10, [0.6, 1.2, 2.0], rollbacks=4),
    _run("llm42", 0.5, 16.0, "ShareGPT", 10, [0.9, 1.9, 3.0], rollbacks=7),
]


def test_series_names_follow_the_paper() -> None:
    assert series_name(RUNS[0]) == "Non-Deterministic"
    assert series_name(RUNS[1]) == "Batch-Invariant"
    assert series_name(RUNS[2]) == "LLM-42 @10%"


def test_make_report_writes_figures_with_their_data(tmp_path: Path) -> None:
    paths = {p.name for p in make_report(RUNS, tmp_path, note="test")}
    assert paths == {"fig10_throughput.png", "fig11_latency_cdf.png", "table4_rollbacks.json",
                     "table4_rollbacks.md", "table5_ttft.json", "table5_ttft.md"}
    for png in ("fig10_throughput.png", "fig11_latency_cdf.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig10 = json.loads((tmp_path / "fig10_throughput.json").read_text())
    assert fig10["groups"] == ["ShareGPT", "ArXiv"]
    assert list(fig10["series"]) == ["Non-Deterministic", "Batch-Invariant", "LLM-42 @10%",
                                     "LLM-42 @100%"]
    assert fig10["series"]["LLM-42 @100%"] == [750, 300]
    assert fig10["series"]["Batch-Invariant"] == [700, None]
    fig11 = json.loads((tmp_path / "fig11_latency_cdf.json").read_text())
    assert list(fig11["panels"]) == ["12 QPS", "16 QPS"]
    assert fig11["panels"]["12 QPS"]["LLM-42 @50%"]["p50_s"] == pytest.approx(1.2)
    assert fig11["panels"]["12 QPS"]["Non-Deterministic"]["e2els_s"] == [0.5, 1.0, 1.5]


def test_tables() -> None:
    t4 = rollback_table(RUNS)
    assert t4["ratios"] == ["10%", "50%", "100%"]
    assert t4["rows"]["ShareGPT"]["100%"]["rollbacks"] == 9
    assert t4["rows"]["ArXiv"]["100%"]["recomputed_tokens"] == 240
    t5 = ttft_table(RUNS)
    assert list(t5["rows"]) == ["12 QPS", "16 QPS", "offline"]
    assert t5["rows"]["12 QPS"]["P50"]["LLM-42 @50%"] == pytest.approx(15.0)
    assert t5["rows"]["16 QPS"]["P50"]["Non-Deterministic"] is None


def test_plot_command_reads_run_files(tmp_path: Path) -> None:
    runs_dir = tmp_path / "res" / "runs"
    runs_dir.mkdir(parents=True)
    for i, r in enumerate(RUNS):
        (runs_dir / f"{i}.json").write_text(json.dumps(r))
    (tmp_path / "res" / "summary.json").write_text("[]")
    assert len(load_runs([tmp_path / "res"])) == len(RUNS)
    assert main(["plot", str(tmp_path / "res"), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "fig11_latency_cdf.png").exists()
    assert main(["plot", str(tmp_path / "nothing"), "--out", str(tmp_path / "p2")]) == 2


def test_named_matrices() -> None:
    off = MATRICES["paper-offline"]
    assert len(off.workloads) == 8
    cells = off.cells()
    # per workload: nondeterministic + batch_invariant + 6 llm42 ratios
    assert len(cells) == 8 * 8
    assert {c.ratio for c in cells if c.mode == "nondeterministic"} == {0.0}
    assert {c.ratio for c in cells if c.mode == "batch_invariant"} == {1.0}
    on = get_matrix("paper-online")
    assert on.qps == (12.0, 14.0, 16.0, 18.0)
    small = on.scaled(num_requests=5, modes=("llm42",), ratios=(0.5,), qps=(2.0,))
    assert [c.slug for c in small.cells()] == ["ShareGPT__llm42__r0.5__q2"]
    assert small.workloads[0].dataset.num_requests == 5
    assert MatrixSpec.from_json(json.loads(json.dumps(off.to_json()))) == off
    with pytest.raises(ValueError):
        get_matrix("no-such-matrix")


def test_run_matrix_on_toy_engine(tmp_path: Path) -> None:
    spec = MatrixSpec("toy", workloads=(Workload("in=12,out=4", DatasetSpec(
        "random", num_requests=6, input_len=12, output_len=4)),),
        modes=("nondeterministic", "llm42", "batch_invariant"), ratios=(0.5, 1.0),
        qps=(math.inf, 200.0), warmup=1)
    made: list[str] = []

    def make(mode: str) -> EngineTarget | None:
        made.append(mode)
        return None if mode == "batch_invariant" else EngineTarget(
            FakeEngine(step_time_s=0.001), label=mode)

    logs: list[str] = []
    runs = asyncio.run(run_matrix(spec, tmp_path, make, ByteTokenizer(), log=logs.append))
    assert made == ["nondeterministic", "llm42", "batch_invariant"]
    assert len(runs) == 2 * 3                               # batch_invariant skipped
    assert any("batch_invariant" in line and "skipped" in line for line in logs)
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert "in12_out4__llm42__r0.5__q200.json" in names
    assert (tmp_path / "traces" / "in12_out4.jsonl").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(row["completed"] == 6 for row in summary)
    assert {row["num_deterministic"] for row in runs if row["labels"]["ratio"] == 0.5} == {3}
    for f in ("fig10_throughput.png", "fig11_latency_cdf.png", "table5_ttft.md"):
        assert (tmp_path / "plots" / f).exists()
    assert json.loads((tmp_path / "matrix.json").read_text())["matrix"]["name"] == "toy"


def test_cli_trace_then_run_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "--dataset", "random", "--num-requests", "6", "--input-len", "20",
                 "--output-len", "5", "--qps", "100", "--deterministic-ratio", "0.5",
                 "--tokenizer", "bytes", "-o", str(trace)]) == 0
    assert '"deterministic": 3' in capsys.readouterr().out
    result = tmp_path / "r.json"
    with running_server(FakeEngine()) as url:
        assert main(["run", "--trace", str(trace), "--target", url, "--no-progress",
                     "--label", "fake", "--result-file", str(result)]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    r = json.loads(result.read_text())
    assert r["completed"] == 6 and r["labels"]["ratio"] == 0.5 and r["labels"]["qps"] == 100
    assert len(r["ttfts"]) == 6 and r["num_deterministic"] == 3


def test_cli_matrix_target_binding_errors() -> None:
    assert main(["matrix", "ci-tiny", "--target", "http://127.0.0.1:9"]) == 2
    assert main(["matrix", "ci-tiny", "--target", "http://a", "--target", "http://b"]) == 2


def test_series_names_name_a_server_configuration_other_than_the_mode() -> None:
    run = {"labels": {"mode": "llm42", "server": "llm42-dedicated", "ratio": 0.1}}
    assert series_name(run) == "LLM-42 [llm42-dedicated] @10%"
    run["labels"]["server"] = "llm42"
    assert series_name(run) == "LLM-42 @10%"
