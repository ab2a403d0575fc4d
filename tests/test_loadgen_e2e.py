"""End to end on CPU: the benchmark CLI against the real engine (SmolLM2-135M, in-process,
offline and online) and, once it exists, against the real HTTP server; each run must leave
the result JSONs, the figures and the tables under one results folder."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.cli import main
from services.redis_server import free_port

SMALL_MATRIX = ["--num-requests", "6", "--ratios", "1.0", "--qps-list", "inf,6",
                "--verify-window", "8", "--verify-group", "4", "--no-progress"]


@pytest.fixture(scope="module")
def smollm2() -> str:
    pytest.importorskip("detserve.engine", reason="the engine is not in the tree yet")
    from detserve.model.fetch import fetch_smollm2

    try:
        return str(fetch_smollm2())
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 could not be fetched: {e}")


def _check_results(out: Path, modes: set[str]) -> None:
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    assert {r["labels"]["mode"] for r in runs} == modes
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
        assert r["total_output_tokens"] > 0 and r["mean_ttft_ms"] > 0
        assert r["p99_e2el_ms"] >= r["median_e2el_ms"] > 0
    dvr = [r for r in runs if r["labels"]["mode"] == "llm42"]
    assert all(r["server_stats"]["verify_passes"] > 0 for r in dvr)
    assert all(r["deterministic"]["completed"] == 6 for r in dvr)
    for name in ("fig10_throughput.png", "fig10_throughput.json", "fig11_latency_cdf.png",
                 "fig11_latency_cdf.json", "table4_rollbacks.md", "table5_ttft.md"):
        assert (out / "plots" / name).stat().st_size > 0, name
    assert len(json.loads((out / "summary.json").read_text())) == len(runs)


@pytest.mark.slow
def test_engine_matrix_end_to_end(tmp_path: Path, smollm2: str) -> None:
    out = tmp_path / "results"
    code = main(["matrix", "ci-tiny", "--target", "engine", "--model", smollm2,
                 "--modes", "nondeterministic,llm42", "--out", str(out), *SMALL_MATRIX])
    assert code == 0
    _check_results(out, {"nondeterministic", "llm42"})
    # the saved base trace replays through `run`, and its result plots on its own
    trace = next((out / "traces").glob("*.jsonl"))
    result = tmp_path / "replay.json"
    assert main(["run", "--trace", str(trace), "--target", "engine", "--model", smollm2,
                 "--mode", "llm42", "--verify-window", "8", "--verify-group", "4",
                 "--no-progress", "--result-file", str(result)]) == 0
    assert json.loads(result.read_text())["completed"] == 6


# ---- the real HTTP server (skipped until the serving layer provides `detserve serve`) ------
def _serve_available() -> bool:
    probe = subprocess.run([sys.executable, "-m", "services.console", "serve", "--help"],
                           capture_output=True, timeout=120)
    return probe.returncode == 0


@contextlib.contextmanager
def _server(model: str, mode: str) -> Iterator[str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "services.console", "serve", "--model", model, "--mode", mode,
           "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(free_port()),
           "--verify-window", "8", "--verify-group", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                pytest.fail(f"server exited with {proc.returncode}: {out[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            pytest.fail("server did not become healthy in 300 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_http_server_matrix_end_to_end(tmp_path: Path, smollm2: str) -> None:
    if not _serve_available():
        pytest.skip("`detserve serve` is not available yet")
    out = tmp_path / "results"
    with _server(smollm2, "llm42") as url:
        code = main(["matrix", "ci-tiny", "--target", f"llm42={url}", "--modes", "llm42",
                     "--tokenizer", smollm2, "--out", str(out), *SMALL_MATRIX])
        assert code == 0
        audit = tmp_path / "audit.json"
        assert main(["audit", "--target", url, "--tokenizer", smollm2, "--audit-modes",
                     "single,mixed", "--n-trials", "3", "--max-tokens", "8",
                     "--no-progress", "-o", str(audit)]) == 0
    _check_results(out, {"llm42"})
    assert json.loads(audit.read_text())["passed"] is True
