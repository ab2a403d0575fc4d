"""The campaign's report: per-run latency tables, saturation, the Figure 11 and Table 5
analogues, and the targets, each miss shown as a miss (pure but for writing files; the PNG
needs matplotlib, without it Figure 11 is a text table of E2E percentiles).

    build_report(runs, meta, out_dir) -> report.md, analysis.json, plots/<dataset>/...
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.campaign.analysis import (
    MIN_KEEP_UP,
    Check,
    e2e_checks,
    keeps_up,
    label,
    rate_of,
    saturation,
    series_of,
    ttft_checks,
)
from loadgen.results import successful_e2els_s
from loadgen.runner import jsonable
from loadgen.stats import percentile
from loadgen.tables import ttft_markdown, ttft_table

METRICS = ("ttft", "tpot", "itl", "e2el")
CDF_POINTS = (10, 25, 50, 75, 90, 95, 99)


def datasets_of(runs: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(str(label(r, "dataset")) for r in runs))


def series_list(runs: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(series_of(r) for r in runs))


def analyse(runs: Sequence[dict[str, Any]], min_ratio: float = MIN_KEEP_UP) -> dict[str, Any]:
    """Saturation per (dataset, series) and the target checks, as JSON."""
    sats = []
    e2e: list[Check] = []
    notes = []
    for d in datasets_of(runs):
        for s in series_list([r for r in runs if label(r, "dataset") == d]):
            sat = saturation(runs, d, s, min_ratio)
            if sat is not None:
                sats.append({"dataset": d, "series": s, "rate": sat.rate,
                             "reached": sat.reached, "describe": sat.describe(),
                             "rates": list(sat.rates), "kept_up": list(sat.kept_up)})
        checks, note = e2e_checks(runs, d, min_ratio=min_ratio)
        e2e += checks
        notes.append(note)
    ttft = ttft_checks(runs)
    return {"keep_up_min_ratio": min_ratio, "saturation": sats,
            "e2e_checks": [c.to_json() for c in e2e], "e2e_notes": notes,
            "ttft_checks": [c.to_json() for c in ttft],
            "e2e_target": verdict(e2e), "ttft_target": verdict(ttft)}


def verdict(checks: Sequence[Check]) -> str:
    """'met', 'missed' (some check failed) or 'not checked' (no run to check)."""
    if not checks:
        return "not checked"
    return "met" if all(c.passed for c in checks) else "missed"


def run_table(runs: Sequence[dict[str, Any]], min_ratio: float = MIN_KEEP_UP) -> str:
    """One row per run: load, throughput, keep-up, P50/P90/P99 of every latency (all
    requests), the deterministic/non-deterministic split (and the latter's ITL) and the
    rollbacks."""
    head = ["series", "req/s", "n", "det n", "ok/fail", "out tok/s", "keep-up"]
    for m in METRICS:
        head.append(f"{m.upper()} P50/P90/P99 ms")
    # the non-deterministic requests' ITL: what co-served deterministic traffic costs them
    head += ["det P99 TTFT / E2E", "non-det P99 TTFT / E2E", "non-det ITL P50/P90/P99 ms",
             "rollbacks", "recomputed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(runs, key=lambda r: (series_list(runs).index(series_of(r)), rate_of(r))):
        k = keeps_up(r, min_ratio)
        cells = [series_of(r), f"{rate_of(r):.3g}", str(r.get("num_prompts", "")),
                 str(r.get("num_deterministic", "")),
                 f"{r.get('completed', 0)}/{r.get('failed', 0)}",
                 f"{r.get('output_throughput', 0.0):.0f}",
                 ("yes" if k.kept_up else "**no**") + f" ({_f(k.ratio, '.2f')})"]
        for m in METRICS:
            cells.append("/".join(_f(r.get(f"{p}_{m}_ms"), ".0f")
                                  for p in ("median", "p90", "p99")))
        for part in ("deterministic", "non_deterministic"):
            sub = r.get(part) or {}
            cells.append(f"{_f(sub.get('p99_ttft_ms'), '.0f')} / {_f(sub.get('p99_e2el_ms'), '.0f')}"
                         if sub.get("completed") else "-")
        nd = r.get("non_deterministic") or {}
        cells.append("/".join(_f(nd.get(f"{p}_itl_ms"), ".2f") for p in ("p50", "p90", "p99"))
                     if nd.get("completed") else "-")
        stats = r.get("server_stats") or {}
        cells += [_f(stats.get("rollbacks"), ".0f"), _f(stats.get("recomputed_tokens"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cdf_text(runs: Sequence[dict[str, Any]]) -> str:
    """Figure 11 as text: E2E percentiles (s) per rate and series."""
    lines = ["| req/s | series | " + " | ".join(f"P{p}" for p in CDF_POINTS) + " |",
             "|---|---|" + "---|" * len(CDF_POINTS)]
    for r in sorted(runs, key=lambda r: (rate_of(r), series_list(runs).index(series_of(r)))):
        xs = successful_e2els_s(r)
        vals = " | ".join(f"{percentile(xs, p):.2f}" if xs else "" for p in CDF_POINTS)
        lines.append(f"| {rate_of(r):.3g} | {series_of(r)} | {vals} |")
    return "\n".join(lines) + "\n"


def figures(runs: Sequence[dict[str, Any]], out: Path, note: str) -> tuple[list[Path], str]:
    """Figure 11 and Table 5 files per dataset (loadgen.report); '' or why no PNG."""
    paths: list[Path] = []
    why = ""
    for d in datasets_of(runs):
        mine = [r for r in runs if label(r, "dataset") == d and math.isfinite(rate_of(r))]
        folder = out / "plots" / _safe(d)
        try:
            from loadgen.report import make_report

            paths += make_report(mine, folder, note=f"{d}, {note}")
        except ImportError as e:   # no matplotlib: the tables alone
            from loadgen.tables import write_tables

            why = f"no PNG ({e}); Figure 11 is given as a table of percentiles"
            paths += write_tables(mine, folder)
    return paths, why


def build_report(runs: Sequence[dict[str, Any]], meta: dict[str, Any], out_dir: str | Path,
                 min_ratio: float = MIN_KEEP_UP) -> Path:
    """Write report.md and analysis.json (and the figures) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = analyse(runs, min_ratio)
    (out / "analysis.json").write_text(json.dumps(jsonable(result), indent=1))
    paths, why = figures(runs, out, str(meta.get("hardware", "")))
    (out / "report.md").write_text(markdown(runs, meta, result, paths, why, out))
    return out / "report.md"


def markdown(runs: Sequence[dict[str, Any]], meta: dict[str, Any], result: dict[str, Any],
             paths: Sequence[Path], why_no_png: str, out: Path) -> str:
    lines = [f"# Online serving campaign ({meta.get('date', '')})", "",
             f"Hardware: {meta.get('hardware', 'unknown')}", "",
             f"Command: `{meta.get('command', '')}`", "",
             f"Model and server flags: `{' '.join(meta.get('server_flags', []))}`", ""]
    lines += _plan_lines(meta)
    lines += ["## Targets", ""]
    lines += _target_lines(result)
    lines += ["", "## Saturation", "",
              f"A run keeps up when no request failed and its keep-up ratio (median arrival "
              f"span between the first and last quarter of the requests over that span plus "
              f"the growth of their median E2E latency; ~ achieved / offered throughput) is "
              f">= {result['keep_up_min_ratio']:g}. A series' saturation rate is the highest "
              "rate at which it and every lower rate kept up "
              "(benchmarks/campaign/analysis.py).", "",
              "| dataset | series | saturation | rates (kept up) |", "|---|---|---|---|"]
    for s in result["saturation"]:
        rates = ", ".join(f"{r:.3g}{'' if ok else ' (no)'}"
                          for r, ok in zip(s["rates"], s["kept_up"], strict=True))
        lines.append(f"| {s['dataset']} | {s['series']} | {s['describe']} | {rates} |")
    png = {p.parent.name: p for p in paths if p.name == "fig11_latency_cdf.png"}
    for d in datasets_of(runs):
        mine = [r for r in runs if label(r, "dataset") == d]
        lines += ["", f"## {d}", "", "### Runs", "", run_table(mine, result["keep_up_min_ratio"]),
                  "### Figure 11 analogue: E2E latency CDFs per rate", ""]
        if _safe(d) in png:
            lines += [f"![Figure 11, {d}]({png[_safe(d)].relative_to(out)})", ""]
        elif why_no_png:
            lines += [why_no_png, ""]
        lines += ["E2E latency percentiles (s):", "", cdf_text(mine),
                  "### Table 5 analogue: TTFT (ms) per rate", "", ttft_markdown(ttft_table(mine))]
    if meta.get("skipped"):
        lines += ["## Skipped at run time", ""] + [f"- {s}" for s in meta["skipped"]] + [""]
    return "\n".join(lines) + "\n"


def _plan_lines(meta: dict[str, Any]) -> list[str]:
    budget = meta.get("budget") or {}
    lines = ["## Plan", "",
             f"Budget {meta.get('budget_s', '?')} s; arrival window {_f(budget.get('window_s'), '.1f')} s "
             f"per run (estimate {_f(budget.get('estimate_s'), '.0f')} s); took "
             f"{_f(meta.get('elapsed_s'), '.0f')} s."]
    if meta.get("client_procs"):
        lines.append(f"- load sent from {meta['client_procs']} client process(es)")
    caps = meta.get("capacity") or {}
    for d, c in caps.items():
        lines.append(f"- capacity probe, {d}: {_f(c.get('rate'), '.3g')} req/s "
                     f"({c.get('requests')} requests at once on {c.get('server')})")
    for note in meta.get("workload_notes", []):
        lines.append(f"- {note}")
    cuts = budget.get("cuts") or []
    lines.append("- cut by the budget: " + ("none" if not cuts else ""))
    lines += [f"  - {c}" for c in cuts]
    if meta.get("extras_run"):
        lines.append("- cut by the planner but run with the time left: "
                     + ", ".join(meta["extras_run"]))
    return lines + [""]


def _target_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"- E2E (10 % deterministic, P99 within {1.05:g}x of nondeterministic up to 80 % of "
             f"its saturation rate): **{result['e2e_target'].upper()}**"]
    lines += [f"  - {n}" for n in result["e2e_notes"]]
    for c in result["e2e_checks"]:
        lines.append(f"  - {c['dataset']} {c['rate']:.3g} req/s: {_f(c['value'], '.3f')}x "
                     f"({c['detail']}) {'ok' if c['passed'] else '**MISS**'}")
    lines.append(f"- TTFT (deterministic P99 within 1.2x of non-deterministic, same run): "
                 f"**{result['ttft_target'].upper()}** (P99 of few deterministic requests is "
                 "their maximum: see the runs' det n)")
    for c in result["ttft_checks"]:
        lines.append(f"  - {c['dataset']} {c['series']} {c['rate']:.3g} req/s: "
                     f"{_f(c['value'], '.3f')}x ({c['detail']}) "
                     f"{'ok' if c['passed'] else '**MISS**'}")
    return lines


def _f(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, fmt)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
