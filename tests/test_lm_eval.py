"""The EleutherAI evaluation harness (``lm-eval``, unmodified) against ``detserve serve``.

The harness cannot send ``is_deterministic``; it can only name a model. Through the
deterministic name (``smollm2:deterministic``) its per-sample results (every choice's
loglikelihood, every generation) must not move with its concurrency, with the fast path
corrupting a fifth of its tokens (fault injection, which the lane catches); through the
plain name the generations do move (the control). Without the faults the plain name's
loglikelihoods moved with the concurrency on some CPUs and not on others (an AMD EPYC
gave the same bits at 1 and 8), so the faults make the control. The harness counts tokens
through the server's ``/tokenize`` routes (no tokenizer download); the tasks and their
data are local files (tests/data/lm_eval). SmolLM2 on CPU, with a small lane (W=16, G=4)
to keep it short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving_cluster import healthy

from services.redis_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(find_spec("lm_eval") is None,
                                 reason="lm-eval not installed (pip install -e '.[dev]')")]
ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "data" / "lm_eval"
MC, GEN = "detserve_mc", "detserve_gen"
STARTUP_S = 300.0
PERTURBATION = 0.2


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """``detserve serve --model smollm2 --device cpu`` in its own process, its fast path
    corrupting tokens; its HTTP URL."""
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "services.console", "serve", "--model", "smollm2",
           "--device", "cpu", "--verify-window", "16", "--verify-group", "4",
           "--fastpath-perturbation", str(PERTURBATION),
           "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url)
        yield url
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"detserve serve exited ({proc.returncode}):\n{out[-4000:]}")
        if healthy(url):
            return
        time.sleep(2)
    raise TimeoutError(f"detserve serve not ready after {STARTUP_S:.0f} s")


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM (the server shuts Ray down), then the whole process group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def evaluate(url: str, model: str, concurrency: int, tasks: list[str]) -> dict[str, list[Any]]:
    """Each task's per-sample responses (loglikelihoods, generations), in document order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": url + "/v1/completions",
                    "num_concurrent": concurrency, "max_retries": 1},
        tasks=tasks, task_manager=TaskManager(include_path=str(TASKS)), log_samples=True)
    assert results is not None
    return {task: [sample["resps"] for sample in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def test_harness_results_do_not_move_with_concurrency(
        server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the task files name their data relative to the repository
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    names = [card["id"] for card in httpx.get(server + "/v1/models").json()["data"]]
    assert names == ["smollm2", "smollm2:deterministic"]

    sequential = evaluate(server, "smollm2:deterministic", 1, [MC, GEN])
    concurrent = evaluate(server, "smollm2:deterministic", 8, [MC, GEN])
    assert len(sequential[MC]) == 8 and len(sequential[GEN]) == 4
    assert all(isinstance(r[0][0], str) for r in sequential[GEN])
    assert sequential[MC] == concurrent[MC], "deterministic loglikelihoods moved"
    assert sequential[GEN] == concurrent[GEN], "deterministic generations moved"

    # control: the plain name's generations move between two runs (its corrupted tokens
    # are released as they are), so the comparison above would catch moved results
    plain_1 = evaluate(server, "smollm2", 1, [GEN])[GEN]
    plain_8 = evaluate(server, "smollm2", 8, [GEN])[GEN]
    differing = sum(a != b for a, b in zip(plain_1, plain_8, strict=True))
    assert differing > 0, "the plain name's generations did not move under the faults"

    metrics = httpx.get(server + "/metrics").text
    # requests: one per choice, one per generation
    asked = {"alias": 2 * (8 * 4 + 4), "default": 2 * 4}
    for source, count in asked.items():
        deterministic = "true" if source == "alias" else "false"
        line = (f'detserve:determinism_requests_total{{deterministic="{deterministic}",'
                f'source="{source}"}} {float(count)}')
        assert line in metrics, line
