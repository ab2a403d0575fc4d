"""Offline throughput over several devices (issue 35): decoders sharing one dedicated
verifier, against as many independent engines as there are devices; output tokens per
second per GPU.

    python -m benchmarks.multi_decoder --model random:llama3-8b --dtype bfloat16 \\
        --devices cuda:0,cuda:1,cuda:2,cuda:3 --lengths sharegpt --num-requests 1536 \\
        --runs dedicated@0.1,dedicated@1.0,replicas:nondeterministic,replicas:batch_invariant \\
        --out results/multi.json

``--runs`` (comma-separated, run in the order given):
- ``dedicated@R``: an embedded Redis and one verifier replica process on the last device
  (``benchmarks.dedicated``); an llm42 decoder engine on each other device, each in a
  process of its own, a ratio R of its requests deterministic, their K/V moved to and from
  the replica (NCCL; gloo on CPU, where the replica counts as another host).
- ``replicas:MODE`` (``replicas:llm42@R``): an engine on every device, each in a process of
  its own, verified (llm42) by its own lane.
The replica is started for the first dedicated run and stopped before a replicas run
needs its device: list the dedicated runs together to start it once.

One request set (``bench_offline``'s lengths, prompts and sampling options) is dealt out:
engine i of n takes requests i, i+n, i+2n, ..., with seed ``--seed + i`` (its prompts, its
deterministic requests, its sampling). Every engine warms up, queues its share, and waits;
then all start together. A run's output throughput is all engines' output tokens over
the span from that start to the last engine's end; per GPU, that over every device the
run occupies (the verifier's included). Each engine's deterministic outputs are hashed per
request (``det_digests``), so that they can be compared with a single engine's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_offline import (
    DEDICATED,
    Weights,
    add_request_flags,
    audit_lines,
    hardware,
    lengths,
    run_one,
)
from benchmarks.dedicated import DedicatedVerifier, VerifierAddress, VerifierClient, die_with_parent
from detserve.config import MODES
from detserve.flags import add_engine_flags
from detserve.model.config import auto_dtype
from detserve.model.loader import read_model_config

LANE_MODES = ("llm42", DEDICATED, "lane_only")


@dataclass(frozen=True)
class RunSpec:
    """One entry of ``--runs``."""

    dedicated: bool
    mode: str  # the engines' mode, as bench_offline names it (llm42-dedicated when dedicated)
    ratio: float  # deterministic requests' share

    @property
    def label(self) -> str:
        if self.dedicated:
            return f"dedicated@{self.ratio:g}"
        return f"replicas:{self.mode}" + (f"@{self.ratio:g}" if self.mode == "llm42" else "")


def parse_runs(text: str) -> list[RunSpec]:
    """``dedicated@R`` and ``replicas:MODE`` / ``replicas:llm42@R`` entries, comma-separated;
    ValueError naming the entry otherwise."""
    runs = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        kind = next((k for k in ("replicas:", "dedicated") if entry.startswith(k)), "")
        body, at, ratio_text = entry[len(kind):].partition("@")
        try:
            ratio = float(ratio_text) if at else None
        except ValueError:
            raise ValueError(f"--runs: {entry!r}: the ratio after @ is not a number") from None
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"--runs: {entry!r}: the ratio must be in [0, 1]")
        if kind == "dedicated" and not body and ratio is not None:
            runs.append(RunSpec(True, DEDICATED, ratio))
        elif kind == "replicas:" and body in MODES and (ratio is not None) == (body == "llm42"):
            runs.append(RunSpec(False, body, ratio if ratio is not None
                                else 1.0 if body in ("batch_invariant", "lane_only") else 0.0))
        else:
            raise ValueError(f"--runs: {entry!r} is not dedicated@R, replicas:llm42@R or "
                             f"replicas:MODE (MODE one of {', '.join(MODES)})")
    if not runs:
        raise ValueError("--runs: no run given")
    return runs


@dataclass(frozen=True)
class Job:
    """What one engine process runs."""

    index: int
    mode: str
    ratio: float
    args: dict[str, Any]  # the parsed flags, with this engine's device and seed
    shapes: list[tuple[int, int]]  # its share of the request set
    verifier: VerifierAddress | None  # the dedicated replica (dedicated runs)


class EngineFailed(RuntimeError):
    """An engine process failed, died or did not report in time."""


def _engine_process(job: Job, conn: Connection, go: Any, wait_s: float) -> None:
    """An engine process: warm up, queue the share, say ready, wait for ``go``, run, send
    the run's record ("done") or the traceback ("error")."""
    die_with_parent()
    try:
        conn.send(("done", _run_job(job, conn, go, wait_s)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()


def _run_job(job: Job, conn: Connection, go: Any, wait_s: float) -> dict[str, Any]:
    args = argparse.Namespace(**job.args)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    # (on CPU every process keeps torch's thread count: the lane's kernel profile names it,
    # and the verifier refuses a decoder whose profile differs)
    # random weights from load_model's fixed seed: the replica loads the same ones
    weights = Weights(args, args.dtype)
    client = VerifierClient(job.verifier, f"decoder{job.index}") if job.verifier else None
    warm = job.shapes[: max(1, min(args.warmup_requests, len(job.shapes)))]
    run_one(weights, args, "nondeterministic", 0.0, warm)  # untimed: kernels compiled, etc.
    if job.mode != "nondeterministic":
        run_one(weights, args, job.mode, 1.0 if job.mode in LANE_MODES else job.ratio, warm,
                dedicated=client)
    started: list[float] = []

    def ready_then_wait() -> None:
        conn.send(("ready", None))
        if not go.wait(wait_s):
            raise TimeoutError(f"no start signal within {wait_s:.0f} s")
        started.append(time.monotonic())

    record = run_one(weights, args, job.mode, job.ratio, job.shapes, dedicated=client,
                     on_start=ready_then_wait)
    if client is not None:
        client.release()
    return {"engine": job.index, "device": args.device, "seed": args.seed,
            "start_monotonic": started[0], **record}


class Engines:
    """One run's engine processes (spawned: CUDA in each), each reached by a pipe; ``gather``
    waits for one message from each with a deadline, failing on any that errs or dies."""

    def __init__(self, jobs: list[Job], wait_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.go = ctx.Event()
        self.jobs = jobs
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for job in jobs:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_engine_process, args=(job, theirs, self.go, wait_s),
                               name=f"engine{job.index}")
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)

    def gather(self, what: str, timeout_s: float,
               watch: DedicatedVerifier | None = None) -> list[Any]:
        """Every engine's next message, which must be ``what``; EngineFailed if one sends an
        error, exits first, or is still silent after ``timeout_s``, or if ``watch`` (the
        verifier replica) exits."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, Any] = {}
        pending = set(range(len(self.procs)))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineFailed(f"engines {sorted(pending)} sent no {what!r} within "
                                   f"{timeout_s:.0f} s")
            if watch is not None and watch.proc.poll() is not None:
                raise EngineFailed(f"the verifier replica exited (code {watch.proc.returncode})")
            wait_any([self.conns[i] for i in pending]
                     + [self.procs[i].sentinel for i in pending], timeout=min(left, 1.0))
            for i in sorted(pending):
                where = f"engine {i} ({self.jobs[i].args['device']})"
                if self.conns[i].poll():
                    try:
                        kind, payload = self.conns[i].recv()
                    except EOFError:
                        raise EngineFailed(f"{where} exited (code {self._code(i)}) before "
                                           f"sending {what!r}") from None
                    if kind == "error":
                        raise EngineFailed(f"{where} failed:\n{payload}")
                    if kind != what:
                        raise EngineFailed(f"{where} sent {kind!r}, expected {what!r}")
                    got[i] = payload
                    pending.discard(i)
                elif not self.procs[i].is_alive():
                    raise EngineFailed(f"{where} exited (code {self._code(i)}) before "
                                       f"sending {what!r}")
        return [got[i] for i in range(len(self.procs))]

    def _code(self, i: int) -> int | None:
        self.procs[i].join(1.0)
        return self.procs[i].exitcode  # type: ignore[no-any-return]

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()


def run_config(spec: RunSpec, args: argparse.Namespace, shapes: list[tuple[int, int]],
               verifier: DedicatedVerifier | None) -> dict[str, Any]:
    """One run: an engine process per device (the last one the verifier's when dedicated),
    started together; their records and the totals."""
    devices = args.devices
    engine_devices = devices[:-1] if spec.dedicated else devices
    n = len(engine_devices)
    jobs = [Job(i, spec.mode, spec.ratio, {**vars(args), "device": dev, "seed": args.seed + i},
                shapes[i::n], verifier.where if verifier is not None else None)
            for i, dev in enumerate(engine_devices)]
    engines = Engines(jobs, args.start_timeout_s + args.run_timeout_s)
    try:
        engines.gather("ready", args.start_timeout_s, verifier)
        engines.go.set()
        records = engines.gather("done", args.run_timeout_s, verifier)
    finally:
        engines.close()
    begin = min(r["start_monotonic"] for r in records)
    end = max(r["start_monotonic"] + r["duration_s"] for r in records)
    out_tokens = sum(r["total_output_tokens"] for r in records)
    span = end - begin
    return {
        "run": spec.label, "mode": spec.mode, "deterministic_ratio": spec.ratio,
        "dedicated": spec.dedicated, "devices": devices, "engine_devices": engine_devices,
        "verifier_device": devices[-1] if spec.dedicated else None,
        "gpus": len(devices), "num_requests": len(shapes),
        "finished_requests": sum(r["finished_requests"] for r in records),
        "total_output_tokens": out_tokens, "duration_s": span,
        "output_throughput": out_tokens / span,
        "output_throughput_per_gpu": out_tokens / span / len(devices),
        "rollbacks": sum(r["rollbacks"] for r in records),
        "recomputed_pct_of_output": 100 * sum(r["recomputed_tokens"] for r in records)
        / max(1, out_tokens),
        # (a dedicated engine's "transfer" reads the replica's busy time and passes: those
        # of every decoder it served over that engine's run)
        "engines": [{k: v for k, v in r.items() if k != "start_monotonic"} for r in records],
    }


def table_line(r: dict[str, Any]) -> str:
    who = (f"{len(r['engine_devices'])} decoders + verifier" if r["dedicated"]
           else f"{len(r['engine_devices'])} engines")
    each = ", ".join(f"{e['output_throughput']:.1f}" for e in r["engines"])
    return (f"{r['run']:>28} {who:>22}: {r['output_throughput']:9.1f} out tok/s, "
            f"{r['output_throughput_per_gpu']:8.1f} per GPU ({r['gpus']}); "
            f"rollbacks={r['rollbacks']:>4} recomputed={r['recomputed_pct_of_output']:5.2f}%; "
            f"per engine {each} tok/s; {r['finished_requests']}/{r['num_requests']} finished")


def audit(runs: list[dict[str, Any]]) -> list[str]:
    """``bench_offline``'s determinism audit over the lane runs, a request named by the
    number of engines its set was dealt to, its engine and its id."""
    keyed = [{"mode": r["mode"],
              "det_digests": {f"{len(r['engines'])}/{e['engine']}/{rid}": d
                              for e in r["engines"] for rid, d in e["det_digests"].items()}}
             for r in runs if r["mode"] in LANE_MODES]
    return audit_lines(keyed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # the engine's flags (generated), the mode and device per run and engine instead
    add_engine_flags(p, skip=("mode", "device"),
                     defaults={"model": "random:tiny", "max_model_len": 2048})
    add_request_flags(p)
    p.add_argument("--devices", required=True,
                   help="comma list, e.g. cuda:0,cuda:1,cuda:2,cuda:3 (or cpu,cpu,cpu); a "
                        "dedicated run puts its verifier on the last")
    p.add_argument("--runs", default="dedicated@0.1,replicas:nondeterministic",
                   help="comma list of dedicated@R, replicas:MODE, replicas:llm42@R")
    p.add_argument("--start-timeout-s", type=float, default=900.0,
                   help="most seconds an engine (or the verifier) may take to load, warm up "
                        "and queue its requests")
    p.add_argument("--run-timeout-s", type=float, default=1800.0,
                   help="most seconds from the start signal to every engine's end")
    p.add_argument("--out", default=None, help="JSON path")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        specs = parse_runs(args.runs)
    except ValueError as e:
        p.error(str(e))
    args.devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if any(s.dedicated for s in specs) and len(args.devices) < 2:
        p.error("a dedicated run needs two devices or more (decoders, then the verifier's)")
    if args.num_requests < len(args.devices):
        p.error("--num-requests: fewer requests than engines")
    kinds = {torch.device(d).type for d in args.devices}
    if kinds - {"cpu", "cuda"} or len(kinds) > 1:
        p.error(f"--devices: all cuda or all cpu, got {args.devices}")
    if "cuda" in kinds and not torch.cuda.is_available():
        p.error("--devices names CUDA devices, but CUDA is not available")
    if args.dtype == "auto":  # resolved once: every engine and the replica agree
        args.dtype = auto_dtype(read_model_config(args.model), args.devices[0])
    shapes = lengths(args.lengths, args.num_requests, args.input_len, args.output_len,
                     args.seed)
    meta = {"date": dt.date.today().isoformat(), "torch": torch.__version__,
            "hardware": {d: hardware(d) for d in dict.fromkeys(args.devices)},
            "command": " ".join(["python -m benchmarks.multi_decoder",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "args": vars(args)}
    runs: list[dict[str, Any]] = []
    verifier: DedicatedVerifier | None = None
    try:
        for spec in specs:
            if spec.dedicated and verifier is None:
                verifier = DedicatedVerifier(args.model, args.dtype, args.devices[-1],
                                             start_timeout_s=args.start_timeout_s)
            elif not spec.dedicated and verifier is not None:  # its device is an engine's now
                verifier.close()
                verifier = None
            runs.append(run_config(spec, args, shapes, verifier))
            print(table_line(runs[-1]), flush=True)
            _save(args.out, meta, runs)  # after every run: a cut-off job keeps its figures
    except (EngineFailed, TimeoutError, RuntimeError) as e:
        print(f"multi_decoder: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if verifier is not None:
            verifier.close()
    for line in audit(runs):
        print(line, flush=True)
    return 0


def _save(path: str | None, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
