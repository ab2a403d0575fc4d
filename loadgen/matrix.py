"""Run a named experiment matrix and write everything under one results folder:

  <out>/matrix.json                 the matrix as run, with host and date
  <out>/traces/<workload>.jsonl     the base trace of each workload (replayable)
  <out>/runs/<cell>.json            one vLLM-style result per cell
  <out>/summary.json                the headline numbers of every cell
  <out>/plots/                      figures and tables (see loadgen.report)

Cells are run mode by mode, so at most one target (one in-process engine) is alive.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loadgen.datasets import build_requests
from loadgen.matrices import Cell, MatrixSpec, Workload
from loadgen.report import make_report
from loadgen.runner import RunConfig, jsonable, run_benchmark, save_result
from loadgen.targets.base import ReplayOptions, Target
from loadgen.tokenizer import Tokenizer
from loadgen.trace import Trace, save_trace
from loadgen.traffic import TrafficSpec, apply_traffic

TargetFactory = Callable[[str], "Target | None"]
SUMMARY_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "median_ttft_ms", "p90_ttft_ms", "median_e2el_ms",
                "p99_e2el_ms", "median_tpot_ms")


async def run_matrix(spec: MatrixSpec, out_dir: str | Path, make_target: TargetFactory,
                     tokenizer: Tokenizer | None = None, cfg: RunConfig | None = None,
                     log: Callable[[str], None] = print, note: str = "") -> list[dict[str, Any]]:
    """Run every cell whose mode ``make_target`` can serve; returns the run results.
    ``note`` (e.g. the hardware) goes into the figure titles next to the matrix name."""
    cfg = cfg or RunConfig(max_concurrency=spec.max_concurrency)
    out = Path(out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    meta = {"matrix": spec.to_json(), "host": platform.node(), "platform": platform.platform(),
            "date": date, "note": note}
    (out / "matrix.json").write_text(json.dumps(jsonable(meta), indent=1))
    traces: dict[str, Trace] = {}
    runs: list[dict[str, Any]] = []
    cells = spec.cells()
    for mode in dict.fromkeys(c.mode for c in cells):
        target = make_target(mode)
        if target is None:
            log(f"[matrix] no target for mode {mode!r}: its cells are skipped")
            continue
        try:
            tok = tokenizer or target.tokenizer
            if tok is None:
                raise ValueError("no tokenizer: give one, or use a target that has one")
            for cell in (c for c in cells if c.mode == mode):
                base = traces.get(cell.workload.name)
                if base is None:
                    base = traces[cell.workload.name] = _base_trace(cell.workload, tok, out)
                runs.append(await _run_cell(spec, cell, base, target, cfg, out, log))
        finally:
            await target.aclose()
    summary = [{"cell": r["labels"]["name"], **r["labels"],
                **{k: r.get(k) for k in SUMMARY_KEYS}, "server_stats": r.get("server_stats")}
               for r in runs]
    (out / "summary.json").write_text(json.dumps(jsonable(summary), indent=1))
    title = f"{spec.name}, {note or platform.node()}, {date[:10]}"
    for path in make_report(runs, out / "plots", note=title):
        log(f"[matrix] wrote {path}")
    return runs


def _base_trace(w: Workload, tok: Tokenizer, out: Path) -> Trace:
    requests, info = build_requests(w.dataset, tok)
    trace = Trace(tuple(requests), {"workload": w.name, "dataset": w.dataset.to_json(),
                                    "tokenizer": tok.name, "dataset_info": info})
    save_trace(trace, out / "traces" / f"{_safe(w.name)}.jsonl")
    return trace


async def _run_cell(spec: MatrixSpec, cell: Cell, base: Trace, target: Target,
                    cfg: RunConfig, out: Path, log: Callable[[str], None]) -> dict[str, Any]:
    traffic = TrafficSpec(qps=cell.qps, burstiness=spec.burstiness,
                          deterministic_ratio=cell.ratio, seed=spec.seed)
    trace = base.with_requests(apply_traffic(base.requests, traffic), traffic=traffic.to_json())
    if spec.warmup:
        warm = [r.with_(id=f"warmup-{cell.slug}-{r.id}", arrival_s=0.0) for r in trace.requests[:spec.warmup]]
        await target.replay(warm, ReplayOptions(cfg.max_concurrency))
    log(f"[matrix] {cell.slug}: {len(trace)} requests")
    result, _ = await run_benchmark(
        target, trace, cfg, name=cell.slug, mode=cell.mode, ratio=cell.ratio,
        qps="inf" if traffic.offline else cell.qps, dataset=cell.workload.name)
    save_result(result, out / "runs" / f"{_safe(cell.slug)}.json")
    return result


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.=" else "_" for ch in name).replace("=", "")
