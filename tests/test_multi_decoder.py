"""The multi-device benchmark on CPU: two decoder processes sharing one dedicated verifier
(another host: gloo), and three independent engines, over one request set.

Every request finishes, the throughput figures are there, and each decoder's deterministic
outputs equal, digest for digest, the ``lane_only`` oracle's for the same requests, with
the fast path perturbed. The control: the same requests on that perturbed fast path,
unverified, give other digests, so the comparison can fail.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from benchmarks import bench_offline, multi_decoder
from benchmarks.multi_decoder import RunSpec, parse_runs
from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.flags import engine_kwargs

REQUESTS = 8
FLAGS = ["--model", "random:tiny", "--dtype", "float32", "--num-requests", str(REQUESTS),
         "--lengths", "sharegpt",
         "--verify-window", "8", "--verify-group", "2", "--warmup-requests", "1",
         "--fastpath-perturbation", "0.2", "--temperature", "0.7", "--logprobs", "1"]
RATIO = 0.5


def engine_args(index: int) -> argparse.Namespace:
    """The flags engine ``index`` of a run ran with (its device and seed)."""
    args = multi_decoder.build_parser().parse_args([*FLAGS, "--devices", "cpu"])
    return argparse.Namespace(**{**vars(args), "device": "cpu", "seed": args.seed + index})


def share(index: int, engines: int) -> list[tuple[int, int]]:
    """Engine ``index``'s share of the request set's lengths."""
    args = engine_args(0)
    shapes = bench_offline.lengths("sharegpt", REQUESTS, args.input_len, args.output_len,
                                   args.seed)
    return shapes[index::engines]


def unverified_digests(loaded: Any, args: argparse.Namespace,
                       shapes: list[tuple[int, int]]) -> dict[str, str]:
    """Every request's digest on the (perturbed) fast path, no lane."""
    cfg = EngineConfig.create(args.model, "nondeterministic", **engine_kwargs(args))
    engine = LLMEngine(cfg, loaded=loaded)
    bench_offline.add_requests(engine, args, RATIO, shapes)
    digests = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            digests[o.request_id] = bench_offline.output_digest(o)
    engine.close()
    return digests


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("multi") / "multi.json"
    assert multi_decoder.main([*FLAGS, "--devices", "cpu,cpu,cpu", "--runs",
                               f"dedicated@{RATIO},replicas:nondeterministic",
                               "--out", str(out)]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_every_request_finishes_and_throughput_is_reported(report: dict[str, Any]) -> None:
    shapes = share(0, 1)
    dedicated, replicas = report["runs"]
    assert report["meta"]["hardware"]["cpu"] and report["meta"]["date"]
    assert (dedicated["run"], replicas["run"]) == (f"dedicated@{RATIO}",
                                                   "replicas:nondeterministic")
    assert dedicated["engine_devices"] == ["cpu", "cpu"] and dedicated["verifier_device"] == "cpu"
    assert len(replicas["engines"]) == 3 and replicas["verifier_device"] is None
    for run in (dedicated, replicas):
        n = len(run["engines"])
        assert run["finished_requests"] == run["num_requests"] == REQUESTS
        assert run["total_output_tokens"] == sum(o for _, o in shapes)
        # each engine took its share: requests i, i+n, ...
        assert [e["num_requests"] for e in run["engines"]] == [len(share(i, n)) for i in range(n)]
        assert [e["finished_requests"] for e in run["engines"]] == [
            e["num_requests"] for e in run["engines"]]
        assert run["gpus"] == 3 and run["output_throughput"] > 0 and run["duration_s"] > 0
        assert run["output_throughput_per_gpu"] == pytest.approx(run["output_throughput"] / 3)
        assert all(e["output_throughput"] > 0 for e in run["engines"])
    for e in dedicated["engines"]:
        assert e["mode"] == "llm42-dedicated" and e["transfer"]["pulled_rows"] > 0
        assert e["rollbacks"] > 0, "the fast path was perturbed"
    assert dedicated["rollbacks"] == sum(e["rollbacks"] for e in dedicated["engines"])


def test_dedicated_outputs_equal_the_lane_oracle_and_the_control_differs(
        report: dict[str, Any]) -> None:
    dedicated = report["runs"][0]
    for e in dedicated["engines"]:
        args = engine_args(e["engine"])
        weights = bench_offline.Weights(args, "float32")
        shapes = share(e["engine"], len(dedicated["engines"]))
        got = e["det_digests"]
        assert len(got) == round(RATIO * len(shapes)) > 0
        # lane_only: every request through the lane, the same requests (same seed, ratio)
        oracle = bench_offline.run_one(weights, args, "lane_only", RATIO, shapes)["det_digests"]
        assert got == {rid: oracle[rid] for rid in got}, f"decoder {e['engine']} differs"
        control = unverified_digests(weights(1), args, shapes)
        assert sorted(control) == sorted(oracle), "the control ran the same requests"
        assert any(control[rid] != d for rid, d in got.items()), (
            "the perturbed, unverified outputs should differ from the verified ones")


def test_runs_are_parsed_and_bad_ones_refused() -> None:
    assert parse_runs("dedicated@0.1, replicas:nondeterministic,replicas:llm42@1,"
                      "replicas:batch_invariant") == [
        RunSpec(True, "llm42-dedicated", 0.1), RunSpec(False, "nondeterministic", 0.0),
        RunSpec(False, "llm42", 1.0), RunSpec(False, "batch_invariant", 1.0)]
    assert [s.label for s in parse_runs("dedicated@1.0,replicas:llm42@0.5")] == [
        "dedicated@1", "replicas:llm42@0.5"]
    for bad in ("dedicated", "dedicated@x", "dedicated@1.5", "replicas:llm42",
                "replicas:nondeterministic@0.1", "replicas:nope", "colocated@0.1", ","):
        with pytest.raises(ValueError, match="--runs"):
            parse_runs(bad)


def test_bad_devices_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for devices, runs, message in (("cpu", "dedicated@0.1", "two devices"),
                                   ("cpu,cuda:0", "replicas:nondeterministic", "all cuda")):
        with pytest.raises(SystemExit):
            multi_decoder.main([*FLAGS, "--devices", devices, "--runs", runs])
        assert message in capsys.readouterr().err


def test_a_failing_engine_fails_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    """An engine process that cannot load its model: a nonzero exit naming it, no hang."""
    flags = [*FLAGS, "--devices", "cpu,cpu", "--runs", "replicas:nondeterministic",
             "--start-timeout-s", "120", "--run-timeout-s", "60"]
    flags[flags.index("random:tiny")] = "random:no-such-shape"
    assert multi_decoder.main(flags) == 1
    err = capsys.readouterr().err
    assert "engine 0 (cpu) failed" in err or "engine 1 (cpu) failed" in err
    assert "no-such-shape" in err
