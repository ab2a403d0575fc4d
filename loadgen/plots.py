"""The paper's figures from run results: each PNG is written next to the JSON it is drawn from.

  fig10_throughput.{png,json}   offline throughput, bars per mode and deterministic ratio,
                                grouped by dataset/config (the paper's Figure 10)
  fig11_latency_cdf.{png,json}  CDFs of end-to-end latency, one panel per QPS, a line per
                                mode and ratio (the paper's Figure 11)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.results import (
    label,
    ordered_series,
    qps_name,
    qps_value,
    series_name,
    successful_e2els_s,
)
from loadgen.stats import ecdf, percentile


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_data(runs: Sequence[dict[str, Any]],
                    metric: str = "total_token_throughput") -> dict[str, Any]:
    groups: list[str] = []
    for r in runs:
        g = str(label(r, "dataset", "trace"))
        if g not in groups:
            groups.append(g)
    series = ordered_series(runs)
    values: dict[str, list[float | None]] = {s: [None] * len(groups) for s in series}
    for r in runs:
        values[series_name(r)][groups.index(str(label(r, "dataset", "trace")))] = r[metric]
    return {"figure": "throughput", "metric": metric, "unit": "tokens/s",
            "groups": groups, "series": values}


def plot_throughput(runs: Sequence[dict[str, Any]], out_dir: str | Path,
                    metric: str = "total_token_throughput", note: str = "") -> Path:
    data = throughput_data(runs, metric)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fig10_throughput.json").write_text(json.dumps(data, indent=1))
    plt = _pyplot()
    groups, series = data["groups"], data["series"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 3), 4.2))
    width = 0.8 / max(1, len(series))
    cmap = plt.get_cmap("viridis")
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        color = _color(name, i, len(series), cmap)
        ax.bar(xs, [v or 0.0 for v in vals], width, label=name, color=color)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(metric.replace("_", " ") + " (tok/s)")
    ax.set_title("Offline throughput" + (f" ({note})" if note else ""))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "fig10_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def latency_cdf_data(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    panels: dict[str, dict[str, Any]] = {}
    for q in sorted({qps_value(r) for r in runs}):
        panel: dict[str, Any] = {}
        for r in sorted((r for r in runs if qps_value(r) == q),
                        key=lambda r: ordered_series(runs).index(series_name(r))):
            xs = sorted(successful_e2els_s(r))
            panel[series_name(r)] = {
                "dataset": label(r, "dataset"), "p50_s": percentile(xs, 50),
                "p90_s": percentile(xs, 90), "p99_s": percentile(xs, 99), "e2els_s": xs}
        panels[qps_name(q)] = panel
    return {"figure": "latency_cdf", "metric": "e2el", "unit": "s", "panels": panels}


def plot_latency_cdf(runs: Sequence[dict[str, Any]], out_dir: str | Path,
                     note: str = "") -> Path:
    data = latency_cdf_data(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fig11_latency_cdf.json").write_text(json.dumps(data, indent=1))
    plt = _pyplot()
    panels = data["panels"]
    n = max(1, len(panels))
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    names = ordered_series(runs)
    cmap = plt.get_cmap("viridis")
    for ax, (title, panel) in zip(axes.flat, panels.items(), strict=False):
        for name, d in panel.items():
            xs, ys = ecdf(d["e2els_s"])
            ax.step(xs, ys, where="post", label=name,
                    color=_color(name, names.index(name), len(names), cmap))
        ax.set_title(title)
        ax.set_xlabel("end-to-end latency (s)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    if note:
        fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    path = out / "fig11_latency_cdf.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _color(name: str, i: int, n: int, cmap: Any) -> Any:
    """Baselines in fixed colours, LLM-42 ratios along a colour map."""
    if name.startswith("Non-Deterministic"):
        return "tab:gray"
    if name.startswith("Batch-Invariant"):
        return "tab:red"
    if name.startswith("Lane-only"):
        return "tab:brown"
    return cmap(0.15 + 0.7 * i / max(1, n - 1))
