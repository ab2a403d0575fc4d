"""The paper's tables from run results, as JSON plus a Markdown rendering.

  table4_rollbacks.{json,md}  rollbacks and recomputed tokens per dataset and deterministic
                              ratio (LLM-42 runs), with the recompute share at 100%
  table5_ttft.{json,md}       TTFT P50/P75/P90 (ms) per QPS and mode/ratio
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.metrics import percentile_key
from loadgen.results import label, ordered_series, qps_name, qps_value, series_name

TTFT_PERCENTILES = (50, 75, 90)


def rollback_table(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    dvr = [r for r in runs if r.get("server_stats") and label(r, "ratio") is not None
           and float(label(r, "ratio")) > 0]
    ratios = sorted({float(label(r, "ratio")) for r in dvr})
    datasets: list[str] = []
    for r in dvr:
        d = str(label(r, "dataset", "trace"))
        if d not in datasets:
            datasets.append(d)
    rows: dict[str, dict[str, Any]] = {}
    for d in datasets:
        row: dict[str, Any] = {}
        for r in dvr:
            if str(label(r, "dataset", "trace")) != d:
                continue
            s = r["server_stats"]
            row[_pct(float(label(r, "ratio")))] = {
                "rollbacks": s.get("rollbacks"), "recomputed_tokens": s.get("recomputed_tokens"),
                "recompute_pct": s.get("recompute_pct"), "qps": qps_name(qps_value(r))}
        rows[d] = row
    return {"table": "rollbacks", "ratios": [_pct(x) for x in ratios], "rows": rows}


def ttft_table(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    series = ordered_series(runs)
    rows: dict[str, dict[str, dict[str, float | None]]] = {}
    for q in sorted({qps_value(r) for r in runs}):
        per_p: dict[str, dict[str, float | None]] = {}
        for p in TTFT_PERCENTILES:
            cells: dict[str, float | None] = dict.fromkeys(series)
            for r in runs:
                if qps_value(r) == q:
                    cells[series_name(r)] = r.get(percentile_key("ttft", p))
            per_p[f"P{p}"] = cells
        rows[qps_name(q)] = per_p
    return {"table": "ttft_ms", "series": series, "rows": rows}


def write_tables(runs: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t4, t5 = rollback_table(runs), ttft_table(runs)
    paths = []
    for name, data, md in (("table4_rollbacks", t4, rollback_markdown(t4)),
                           ("table5_ttft", t5, ttft_markdown(t5))):
        (out / f"{name}.json").write_text(json.dumps(data, indent=1))
        (out / f"{name}.md").write_text(md)
        paths += [out / f"{name}.json", out / f"{name}.md"]
    return paths


def rollback_markdown(t: dict[str, Any]) -> str:
    ratios = t["ratios"]
    head = "| Dataset / Config | " + " | ".join(ratios) + " |\n|---|" + "---|" * len(ratios)
    lines = ["**Total number of rollbacks**", "", head]
    for d, row in t["rows"].items():
        lines.append(f"| {d} | " + " | ".join(_num(row.get(x, {}).get("rollbacks"))
                                              for x in ratios) + " |")
    lines += ["", "**Total number of recomputed tokens**", "", head]
    for d, row in t["rows"].items():
        cells = []
        for x in ratios:
            cell = row.get(x, {})
            text = _num(cell.get("recomputed_tokens"))
            if x == "100%" and cell.get("recompute_pct") is not None:
                text += f" ({cell['recompute_pct']:.2f}%)"
            cells.append(text)
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ttft_markdown(t: dict[str, Any]) -> str:
    series = t["series"]
    lines = ["| QPS | TTFT | " + " | ".join(series) + " |",
             "|---|---|" + "---|" * len(series)]
    for q, per_p in t["rows"].items():
        for p, cells in per_p.items():
            vals = " | ".join("" if cells[s] is None else f"{cells[s]:.1f}" for s in series)
            lines.append(f"| {q} | {p} | {vals} |")
    return "\n".join(lines) + "\n"


def _pct(ratio: float) -> str:
    return f"{ratio * 100:g}%"


def _num(v: Any) -> str:
    return "" if v is None else f"{v:.0f}"
