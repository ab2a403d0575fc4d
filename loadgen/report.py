"""Every figure and table of a set of runs, written into one folder."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.plots import plot_latency_cdf, plot_throughput
from loadgen.results import qps_value
from loadgen.tables import write_tables


def make_report(runs: Sequence[dict[str, Any]], out_dir: str | Path,
                note: str = "") -> list[Path]:
    """Figure 10 from offline runs (QPS = inf), Figure 11 from online runs (finite QPS),
    Tables 4 and 5 from all runs. Returns the files written."""
    out = Path(out_dir)
    offline = [r for r in runs if math.isinf(qps_value(r))]
    online = [r for r in runs if not math.isinf(qps_value(r))]
    paths: list[Path] = []
    if offline:
        paths.append(plot_throughput(offline, out, note=note))
    if online:
        paths.append(plot_latency_cdf(online, out, note=note))
    if runs:
        paths += write_tables(runs, out)
    return paths
