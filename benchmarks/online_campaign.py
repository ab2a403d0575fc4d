"""The online serving campaign (issue 37): Figure 11 and Table 5 through `detserve serve`.

Three steps; only ``run`` needs the GPU:

    # 1. base traces (CPU, here: needs the data cache; writes JSONL files to carry along)
    python -m benchmarks.online_campaign prepare --profile 8b --out results/campaign-traces
    # 2. the matrix: servers started mode by mode, Poisson replays, report (one GPU call)
    python -m benchmarks.online_campaign run --profile 8b --traces results/campaign-traces \\
        --budget-s 480 --out results/campaign-8b
    # 3. (optional) the report again from the results folder
    python -m benchmarks.online_campaign report results/campaign-8b

``run`` starts one `detserve serve` per server configuration of the series (``--series
nondeterministic@0,llm42@0.1,...``: SERVER@DETERMINISTIC_SHARE, servers in
``benchmarks.campaign.plan.SERVERS``), measures the first server's capacity with a burst
per dataset, replays each dataset at ``--fractions`` of that capacity (or ``--rates``), and
writes per run a loadgen result JSON (``runs/``), then ``report.md`` and ``analysis.json``
(saturation, targets) and the figures (``plots/<dataset>/``). The whole matrix stays inside
``--budget-s``: the planner shortens every run's window and cuts runs (it says which), and
the driver skips what no longer fits as it goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.campaign.analysis import MIN_KEEP_UP, keeps_up
from benchmarks.campaign.plan import (
    DEFAULT_SERIES,
    Budgeted,
    CampaignPlan,
    CellPlan,
    DatasetPlan,
    Series,
    TimeModel,
    budget_cells,
    num_requests,
)
from benchmarks.campaign.report import build_report
from loadgen.datasets import DatasetSpec
from loadgen.runner import RunConfig, jsonable, run_benchmark, save_result
from loadgen.stats import percentile
from loadgen.targets.base import Target
from loadgen.targets.openai_http import OpenAIHTTPTarget
from loadgen.targets.sharded import ShardedHTTPTarget
from loadgen.trace import Trace, load_trace, save_trace
from loadgen.traffic import TrafficSpec, apply_traffic

PERCENTILES = (50.0, 75.0, 90.0, 99.0)


@dataclass(frozen=True)
class Profile:
    """A model and machine: the server's common flags, how base traces are built, and the
    time model the budget planner uses."""

    server_flags: tuple[str, ...]
    tokenizer: str
    send_token_ids: bool          # the random-weight models' tokenizers are not the data's
    datasets: dict[str, DatasetSpec]
    drain_s: dict[str, float]
    output_cap: int | None        # outputs longer than this are cut (bounds the drain)
    probe_requests: dict[str, int]
    time_model: TimeModel = field(default_factory=TimeModel)
    client_procs: int = 4         # client processes sending the load (loadgen.targets.sharded)
    notes: tuple[str, ...] = ()


PROFILES: dict[str, Profile] = {
    # Llama-3.1-8B shape, seeded random weights, one GPU; prompts counted and sent as Llama-3
    # token ids (the random model's own tokenizer is a word list)
    "8b": Profile(
        # KV: 12,288 blocks of 16 tokens, 2 MiB each (24 GiB), beside 2 x 16 GB of weights
        # (decoder and co-located verifier)
        server_flags=("--model", "random:llama3-8b", "--device", "cuda", "--dtype", "bfloat16",
                      "--max-num-seqs", "128", "--num-blocks", "12288",
                      "--max-model-len", "16384"),
        tokenizer="llama3", send_token_ids=True,
        datasets={"sharegpt": DatasetSpec("sharegpt", num_requests=3000),
                  "arxiv-like": DatasetSpec("arxiv-like", num_requests=100,
                                            max_input_len=15000)},
        drain_s={"sharegpt": 15.0, "arxiv-like": 20.0}, output_cap=512,
        probe_requests={"sharegpt": 256, "arxiv-like": 48},
        time_model=TimeModel(start_s=50.0, stop_s=10.0, probe_s=20.0, min_window_s=8.0),
        notes=("ShareGPT outputs cut at 512 tokens and ArXiv-like prompts at 15,000 (so a run "
               "drains within its allowance); every request ignores EOS (random weights)",)),
    # SmolLM2-135M with real weights (the staged GGUF): text prompts, the server tokenizes
    "smollm2": Profile(
        server_flags=("--model", "/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf", "--device",
                      "cuda", "--dtype", "bfloat16", "--max-num-seqs", "128",
                      "--num-blocks", "16384", "--max-model-len", "8192"),
        tokenizer="/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf", send_token_ids=False,
        datasets={"sharegpt": DatasetSpec("sharegpt", num_requests=3000),
                  "arxiv-like": DatasetSpec("arxiv-like", num_requests=200,
                                            max_input_len=7000)},
        drain_s={"sharegpt": 10.0, "arxiv-like": 10.0}, output_cap=512,
        probe_requests={"sharegpt": 256, "arxiv-like": 64},
        time_model=TimeModel(start_s=40.0, stop_s=10.0, probe_s=15.0),
        notes=("ShareGPT outputs cut at 512 tokens, ArXiv-like prompts at 7,000",)),
    # a smoke test of the driver on two CPU cores: the tiny random model, byte-token prompts
    "cpu-smoke": Profile(
        server_flags=("--model", "random:tiny", "--device", "cpu", "--max-num-seqs", "8",
                      "--max-model-len", "256", "--verify-window", "8", "--verify-group", "4"),
        tokenizer="bytes", send_token_ids=True,
        datasets={"random": DatasetSpec("random", num_requests=64, input_len=16,
                                        output_len=8, range_ratio=0.5)},
        drain_s={"random": 8.0}, output_cap=None, probe_requests={"random": 16},
        time_model=TimeModel(start_s=30.0, stop_s=5.0, probe_s=5.0, min_window_s=2.0,
                             min_requests=4), client_procs=1),
}


# ---- prepare ---------------------------------------------------------------------------
def prepare(profile: Profile, out: Path, datasets: Sequence[str], seed: int = 0) -> list[Path]:
    """Base traces (arrivals 0, no deterministic flag) of ``datasets``, tokenized with the
    profile's tokenizer; token ids attached where the profile sends ids."""
    from loadgen.datasets import build_requests
    from loadgen.tokenizer import load_tokenizer

    tok = load_tokenizer(profile.tokenizer)
    paths = []
    for name in datasets:
        spec = replace(profile.datasets[name], seed=seed)
        requests, info = build_requests(spec, tok)
        fixed = []
        for r in requests:
            changes: dict[str, Any] = {"ignore_eos": True}
            if profile.output_cap is not None:
                changes["output_len"] = min(r.output_len, profile.output_cap)
            if profile.send_token_ids:
                # the ids are what is sent: the text is dropped, which keeps the file small
                ids = r.prompt_token_ids or tuple(tok.encode(r.prompt))
                changes.update(prompt_token_ids=ids, prompt_len=len(ids), prompt="")
            fixed.append(r.with_(**changes))
        meta = {"dataset": spec.to_json(), "tokenizer": tok.name, "dataset_info": info,
                "output_cap": profile.output_cap, "ignore_eos": True}
        path = save_trace(Trace(tuple(fixed), meta), out / f"{name}.jsonl")
        print(f"{path}: {json.dumps(Trace(tuple(fixed)).summary())}", flush=True)
        paths.append(path)
    return paths


# ---- run -------------------------------------------------------------------------------
@dataclass
class Campaign:
    """State of one ``run``: the plan, the clock, what ran and what was skipped."""

    profile: Profile
    plan: CampaignPlan
    budget: Budgeted
    out: Path
    budget_s: float
    extra_flags: tuple[str, ...]
    min_ratio: float
    stop_at_saturation: bool
    client_procs: int = 1
    t0: float = field(default_factory=time.perf_counter)
    bases: dict[str, Trace] = field(default_factory=dict)
    capacity: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)   # cut by the planner, run after all
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def log(self, msg: str) -> None:
        print(f"[campaign {time.perf_counter() - self.t0:6.0f}s] {msg}", flush=True)

    def device(self) -> str:
        flags = self.profile.server_flags
        return flags[flags.index("--device") + 1] if "--device" in flags else "cpu"

    def ordered(self, cells: list[CellPlan]) -> list[CellPlan]:
        """Dataset, then series, then rate point, each in the plan's order."""
        names = [d.name for d in self.plan.datasets]
        return sorted(cells, key=lambda x: (names.index(x.dataset),
                                            self.plan.series.index(x.series), x.point))

    def cell_cost(self, cell: CellPlan) -> float:
        drain = {d.name: d.drain_s for d in self.plan.datasets}[cell.dataset]
        return self.budget.window_s + drain


async def run_campaign(c: Campaign) -> None:
    """Server by server: its planned runs, then the runs the planner cut for it while the
    time left still covers the later servers' planned work (runs end before their
    allowance, so time is usually left over)."""
    tm = c.profile.time_model
    kept = list(c.budget.cells)
    cut = [x for x in c.plan.cells() if x not in kept]
    servers = c.plan.server_order(kept)
    for i, server in enumerate(servers):
        mine = c.ordered([x for x in kept if x.series.server == server])
        extras = c.ordered([x for x in cut if x.series.server == server])
        reserve = sum(tm.start_s + tm.stop_s + sum(c.cell_cost(x) for x in kept
                                                   if x.series.server == later)
                      for later in servers[i + 1:])
        need = tm.start_s + tm.stop_s + min(c.cell_cost(x) for x in mine)
        if c.left() < need:
            c.skipped += [f"{x.key}: server {server} not started, {c.left():.0f} s left "
                          f"(needs ~{need:.0f})" for x in mine]
            continue
        await serve_cells(c, server, mine, extras, reserve)


async def serve_cells(c: Campaign, server: str, cells: list[CellPlan],
                      extras: list[CellPlan], reserve_s: float) -> None:
    from benchmarks.campaign.server import ServeProcess, ServerFailed

    spec = c.plan.servers[server]
    flags = (*c.profile.server_flags, *spec.args(c.device()), *c.extra_flags)
    proc = ServeProcess(flags, c.out / "servers" / f"{server}.log",
                        start_timeout_s=max(60.0, min(600.0, c.left() - 30.0)))
    c.log(f"starting {server}: detserve serve {shlex.join(flags)}")
    try:
        proc.start()
    except ServerFailed as e:
        c.log(f"server {server} failed to start: {str(e).splitlines()[0]}")
        c.skipped += [f"{x.key}: server {server} failed to start ({proc.log_path})"
                      for x in cells]
        c.servers[server] = {"started": False, "log": str(proc.log_path)}
        return
    c.servers[server] = {"started": True, "startup_s": proc.startup_s, "flags": list(flags)}
    c.log(f"{server} ready in {proc.startup_s:.0f} s at {proc.url}")
    target = make_client(proc.url, c.client_procs, send_token_ids=c.profile.send_token_ids,
                         label=server)
    try:
        await warm_up(c, target, cells)
        failed_at: dict[tuple[str, str], float] = {}
        for cell in cells:
            await run_cell(c, server, target, cell, failed_at)
        for cell in extras:
            if c.left() - reserve_s >= c.cell_cost(cell) + c.profile.time_model.stop_s:
                c.log(f"{cell.key}: cut by the planner, run with the time left")
                c.extras.append(cell.key)
                await run_cell(c, server, target, cell, failed_at)
    finally:
        await target.aclose()
        proc.stop()


def make_client(url: str, procs: int, **http_args: Any) -> Target:
    """The HTTP target the load is sent through: from ``procs`` client processes."""
    if procs > 1:
        return ShardedHTTPTarget(url, procs, **http_args)
    return OpenAIHTTPTarget(url, **http_args)


# warm-up: requests of each dataset sent at once, and the output cap of the
# non-deterministic and the deterministic ones (several windows each, so that lane passes
# of every size run before the first measured request: a pass size's first run, or a
# transfer's, would otherwise land in a run's tail)
WARM_REQUESTS, WARM_TOKENS, WARM_DET_TOKENS = 32, 16, 256


async def warm_up(c: Campaign, target: Target, cells: list[CellPlan]) -> None:
    """Short requests of each dataset (half of them deterministic and longer, where a run
    has deterministic traffic), then the capacity probe of every dataset that needs one
    and has none yet. (Probes stay within the router's admission bound, 2 x max_num_seqs
    outstanding, or they would meet 429s.)"""
    det = any(x.series.ratio > 0 for x in cells)
    for d in dict.fromkeys(x.dataset for x in cells):
        warm = []
        for i, r in enumerate(c.bases[d].requests[:WARM_REQUESTS]):
            is_det = det and i % 2 == 1
            warm.append(r.with_(id=f"warm-{r.id}", is_deterministic=is_det,
                                output_len=min(r.output_len,
                                               WARM_DET_TOKENS if is_det else WARM_TOKENS)))
        await run_benchmark(target, Trace(tuple(warm)), RunConfig(progress=False,
                            keep_texts=False, request_timeout_s=120.0))
        if c.plan.needs_probe(d) and d not in c.capacity:
            c.capacity[d] = await probe_capacity(c, target, d)


async def probe_capacity(c: Campaign, target: Target, dataset: str
                         ) -> dict[str, Any]:
    """Requests per second the server completes with a full batch: a burst (all requests
    at t=0), counted between the 25th and the 75th percentile of the completion times, so
    neither the ramp-up nor the drain counts."""
    n = min(len(c.bases[dataset]), c.profile.probe_requests.get(dataset, 128))
    burst = [r.with_(id=f"probe-{r.id}") for r in c.bases[dataset].requests[-n:]]
    result, _ = await run_benchmark(target, Trace(tuple(burst)),
                                    RunConfig(progress=False, keep_texts=False,
                                              request_timeout_s=300.0))
    rate = burst_rate(result.get("starts", []), result.get("e2els", []),
                      result.get("errors", []))
    c.log(f"capacity {dataset}: {rate:.3g} req/s from a burst of {n} "
          f"({result['completed']} completed in {result['duration']:.1f} s)")
    return {"rate": rate, "requests": n, "server": target.label,
            "duration_s": result["duration"], "completed": result["completed"]}


def burst_rate(starts: Sequence[float], e2els: Sequence[float],
               errors: Sequence[str]) -> float:
    """Completions per second between the 25th and 75th percentile completion times of a
    burst; 0.0 when fewer than 4 requests succeeded."""
    done = sorted(s + e for s, e, err in zip(starts, e2els, errors, strict=False) if not err)
    if len(done) < 4:
        return 0.0
    lo, hi = percentile(done, 25), percentile(done, 75)
    return 0.5 * (len(done) - 1) / (hi - lo) if hi > lo else 0.0


async def run_cell(c: Campaign, server: str, target: Target, cell: CellPlan,
                   failed_at: dict[tuple[str, str], float]) -> None:
    tm = c.profile.time_model
    key = (cell.dataset, cell.series.name)
    cap = c.capacity.get(cell.dataset, {}).get("rate")
    try:
        rate = c.plan.rate(cell.dataset, cell.point, cap)
    except ValueError as e:
        c.skipped.append(f"{cell.key}: {e}")
        return
    if c.stop_at_saturation and key in failed_at and rate > failed_at[key]:
        c.skipped.append(f"{cell.key}: {rate:.3g} req/s is past {failed_at[key]:.3g}, where "
                         f"{cell.series.name} did not keep up")
        return
    if c.left() < c.cell_cost(cell) + tm.stop_s:
        c.skipped.append(f"{cell.key}: {c.left():.0f} s left, the run needs "
                         f"~{c.cell_cost(cell):.0f}")
        return
    base = c.bases[cell.dataset]
    n = num_requests(rate, c.budget.window_s, tm, len(base))
    traffic = TrafficSpec(qps=rate, deterministic_ratio=cell.series.ratio, seed=cell.point)
    requests = apply_traffic(base.requests[:n], traffic)
    trace = base.with_requests(requests, traffic=traffic.to_json())
    span = requests[-1].arrival_s if requests else 0.0
    drain = {d.name: d.drain_s for d in c.plan.datasets}[cell.dataset]
    cfg = RunConfig(percentiles=PERCENTILES, progress=False, keep_texts=False,
                    request_timeout_s=span + drain, deadline_s=span + drain)
    await wait_idle(target)
    name = f"{cell.dataset}__{cell.series.name}__q{rate:.4g}"
    fraction = None if cell.dataset in c.plan.rates else c.plan.fractions[cell.point]
    result, _ = await run_benchmark(
        target, trace, cfg, name=name, mode=c.plan.servers[server].mode, server=server,
        series=cell.series.name, ratio=cell.series.ratio, qps=rate, dataset=cell.dataset,
        fraction=fraction, window_s=c.budget.window_s)
    save_result(result, c.out / "runs" / f"{_safe(name)}.json")
    c.runs.append(result)
    k = keeps_up(result, c.min_ratio)
    if not k.kept_up:
        failed_at[key] = min(failed_at.get(key, math.inf), rate)
    c.log(f"{name}: {n} requests, {result['completed']} ok, {result['failed']} failed, "
          f"P99 E2E {result.get('p99_e2el_ms', 0):.0f} ms, P99 TTFT "
          f"{result.get('p99_ttft_ms', 0):.0f} ms, {result['output_throughput']:.0f} out tok/s"
          f", kept up: {k.kept_up} ({k.why})")


async def wait_idle(target: Target, timeout_s: float = 15.0) -> None:
    """Until the router reports no running or waiting request (what a run that timed
    out left behind is aborted or finished), at most ``timeout_s``."""
    end = time.perf_counter() + timeout_s
    while time.perf_counter() < end:
        stats = await target.server_stats()
        if not stats.get("num_requests_running") and not stats.get("num_requests_waiting"):
            return
        await asyncio.sleep(0.5)


def hardware(device: str) -> str:
    if device.startswith("cuda"):
        try:
            import torch

            p = torch.cuda.get_device_properties(0)
            return (f"{p.name} ({p.multi_processor_count} SMs, "
                    f"{p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}")
        except Exception as e:  # the report still gets written
            return f"cuda (no device properties: {e})"
    return f"{platform.processor() or platform.machine()} CPU, {platform.node()}"


def run_main(a: argparse.Namespace) -> int:
    profile = PROFILES[a.profile]
    tm = replace(profile.time_model, **{k: v for k, v in (("start_s", a.start_s),
                                                           ("min_window_s", a.min_window_s))
                                        if v is not None})
    profile = replace(profile, time_model=tm)
    names = a.datasets.split(",") if a.datasets else list(profile.datasets)
    traces = Path(a.traces)
    datasets = tuple(DatasetPlan(n, str(traces / f"{n}.jsonl"), profile.drain_s.get(n, 15.0))
                     for n in names)
    plan = CampaignPlan(datasets, tuple(Series.parse(s) for s in a.series.split(",")),
                        fractions=a.fractions, rates=parse_rates(a.rates))
    budgeted = budget_cells(plan, a.budget_s, tm)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    c = Campaign(profile, plan, budgeted, out, a.budget_s, tuple(shlex.split(a.server_args)),
                 a.min_keep_up, not a.run_past_saturation,
                 a.client_procs or profile.client_procs)
    c.log(f"plan: {len(budgeted.cells)} runs, window {budgeted.window_s:.1f} s, estimate "
          f"{budgeted.estimate_s:.0f} s of {a.budget_s:g}; cut: {list(budgeted.cuts) or 'none'}")
    for d in datasets:
        c.bases[d.name] = load_trace(d.trace)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        asyncio.run(run_campaign(c))
    finally:
        meta = {"date": date, "hardware": hardware(c.device()),
                "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                "server_flags": list(profile.server_flags) + list(c.extra_flags),
                "profile": a.profile, "budget_s": a.budget_s, "budget": budgeted.to_json(),
                "plan": plan.to_json(), "time_model": vars(tm), "capacity": c.capacity,
                "servers": c.servers, "skipped": c.skipped, "extras_run": c.extras,
                "elapsed_s": time.perf_counter() - c.t0, "client_procs": c.client_procs,
                "workload_notes": list(profile.notes)}
        (out / "campaign.json").write_text(json.dumps(jsonable(meta), indent=1))
        report = build_report(c.runs, meta, out, a.min_keep_up)
        c.log(f"report: {report}")
        print(summary_table(c.runs, a.min_keep_up), flush=True)
    return 0 if c.runs else 1


def summary_table(runs: Sequence[dict[str, Any]], min_ratio: float = MIN_KEEP_UP) -> str:
    rows = [f"{'dataset':<11}{'series':<22}{'req/s':>7}{'ok/fail':>9}{'P99 E2E':>9}"
            f"{'P99 TTFT':>10}{'det/nd P99 TTFT':>17}{'keep-up':>9}"]
    for r in runs:
        lab = r.get("labels", {})
        det, nd = r.get("deterministic") or {}, r.get("non_deterministic") or {}
        split = (f"{det.get('p99_ttft_ms', 0):.0f}/{nd.get('p99_ttft_ms', 0):.0f}"
                 if det.get("completed") and nd.get("completed") else "-")
        k = keeps_up(r, min_ratio)
        rows.append(f"{lab.get('dataset', ''):<11}{lab.get('series', ''):<22}"
                    f"{float(lab.get('qps', 0)):>7.3g}"
                    f"{str(r['completed']) + '/' + str(r['failed']):>9}"
                    f"{r.get('p99_e2el_ms', 0) / 1e3:>8.2f}s{r.get('p99_ttft_ms', 0):>8.0f}ms"
                    f"{split:>17}{'yes' if k.kept_up else 'NO':>9}")
    return "\n".join(rows)


def parse_rates(text: str | None) -> dict[str, tuple[float, ...]]:
    """``sharegpt=4,8,12;arxiv-like=0.5,1`` -> {dataset: rates}."""
    out: dict[str, tuple[float, ...]] = {}
    for part in (text or "").split(";"):
        if not part.strip():
            continue
        name, sep, rates = part.partition("=")
        if not sep:
            raise ValueError(f"--rates {part!r}: write DATASET=R1,R2,...")
        out[name.strip()] = tuple(float(x) for x in rates.split(",") if x.strip())
    return out


def report_main(a: argparse.Namespace) -> int:
    from loadgen.results import load_runs

    out = Path(a.results)
    meta = json.loads((out / "campaign.json").read_text())
    runs = load_runs([out])
    print(build_report(runs, meta, out, a.min_keep_up))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("prepare", help="build the base traces (CPU; needs the data cache)")
    pr.add_argument("--profile", choices=sorted(PROFILES), default="8b")
    pr.add_argument("--datasets", help="comma-separated (default: the profile's)")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--out", required=True)
    r = sub.add_parser("run", help="serve mode by mode and replay (the GPU part)")
    r.add_argument("--profile", choices=sorted(PROFILES), default="8b")
    r.add_argument("--traces", required=True, help="folder of <dataset>.jsonl (prepare)")
    r.add_argument("--datasets", help="comma-separated subset, in priority order")
    r.add_argument("--series", default=",".join(DEFAULT_SERIES),
                   help="SERVER@RATIO list in priority order (default: %(default)s)")
    r.add_argument("--fractions", type=_floats, default=(0.4, 0.8, 1.0),
                   help="rates as fractions of the first server's burst capacity")
    r.add_argument("--rates", help="explicit rates instead, e.g. 'sharegpt=4,8,12'")
    r.add_argument("--budget-s", type=float, default=480.0,
                   help="the whole matrix, server starts included")
    r.add_argument("--start-s", type=float, help="estimate of one server start (planner)")
    r.add_argument("--min-window-s", type=float, help="shortest arrival window (planner)")
    r.add_argument("--server-args", default="", help="more `detserve serve` flags")
    r.add_argument("--min-keep-up", type=float, default=MIN_KEEP_UP)
    r.add_argument("--client-procs", type=int,
                   help="client processes sending the load (default: the profile's)")
    r.add_argument("--run-past-saturation", action="store_true",
                   help="also run a series' rates above one where it did not keep up")
    r.add_argument("--out", required=True)
    rp = sub.add_parser("report", help="write the report again from a results folder")
    rp.add_argument("results")
    rp.add_argument("--min-keep-up", type=float, default=MIN_KEEP_UP)
    return p


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.@" else "_" for ch in name)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.command == "prepare":
        profile = PROFILES[a.profile]
        names = a.datasets.split(",") if a.datasets else list(profile.datasets)
        prepare(profile, Path(a.out), names, a.seed)
        return 0
    if a.command == "report":
        return report_main(a)
    return run_main(a)


if __name__ == "__main__":
    sys.exit(main())
