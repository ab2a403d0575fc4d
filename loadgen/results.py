"""Reading run results back and naming them the way the paper's figures do.

A run result (see loadgen.runner) carries ``labels``: ``mode``, ``ratio`` (deterministic
fraction), ``qps`` and ``dataset``. Figures and tables group runs by these labels.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MODE_ORDER = ("nondeterministic", "batch_invariant", "lane_only", "llm42")
MODE_NAMES = {"nondeterministic": "Non-Deterministic", "batch_invariant": "Batch-Invariant",
              "lane_only": "Lane-only", "llm42": "LLM-42"}
RATIO_MODES = ("llm42",)   # only selective determinism has a meaningful ratio


def load_runs(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Run results from files and folders (folders: every ``*.json`` under ``runs/`` or
    directly inside, skipping the figure/table JSONs)."""
    runs = []
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(
            (p / "runs").glob("*.json") if (p / "runs").is_dir() else p.glob("*.json"))
        for f in files:
            d = json.loads(f.read_text())
            if isinstance(d, dict) and "labels" in d and "completed" in d:
                runs.append(d)
    return runs


def label(run: dict[str, Any], key: str, default: Any = None) -> Any:
    return run.get("labels", {}).get(key, default)


def qps_value(run: dict[str, Any]) -> float:
    q = label(run, "qps", run.get("request_rate", "inf"))
    return math.inf if q in (None, "inf") else float(q)


def qps_name(q: float) -> str:
    return "offline" if math.isinf(q) else f"{q:g} QPS"


def series_name(run: dict[str, Any]) -> str:
    """The mode's name, its deterministic share where it has one, and the server's
    configuration (label ``server``) where that is not the mode's plain one (e.g. LLM-42
    with a dedicated verifier GPU)."""
    mode = str(label(run, "mode", run.get("target", "?")))
    name = MODE_NAMES.get(mode, mode)
    server = label(run, "server")
    if server is not None and server != mode:
        name += f" [{server}]"
    ratio = label(run, "ratio")
    if mode in RATIO_MODES and ratio is not None:
        name += f" @{float(ratio) * 100:g}%"
    return name


def series_sort_key(run: dict[str, Any]) -> tuple[int, float, str]:
    mode = str(label(run, "mode", ""))
    order = MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)
    return order, float(label(run, "ratio", 0.0) or 0.0), series_name(run)


def ordered_series(runs: Iterable[dict[str, Any]]) -> list[str]:
    seen: dict[str, tuple[int, float, str]] = {}
    for r in runs:
        seen.setdefault(series_name(r), series_sort_key(r))
    return sorted(seen, key=lambda s: seen[s])


def successful_e2els_s(run: dict[str, Any]) -> list[float]:
    errors = run.get("errors") or [""] * len(run.get("e2els", []))
    return [e for e, err in zip(run.get("e2els", []), errors, strict=False) if not err]
