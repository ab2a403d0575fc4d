"""Deterministic outputs of ``bench_offline`` results compared across files: the same
requests run in two calls, builds or TP sizes (the TP-invariance audit: the invariant lane
at TP 1 and 4; its control: the ordinary lane at both).

For each deterministic ratio the files share, the runs of ``--mode`` are audited together
as ``bench_offline`` audits the runs of one call (``audit_lines``): a request with one
output everywhere agrees across the files.

    python -m benchmarks.compare_digests tp1-inv.json tp4-inv.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.bench_offline import audit_lines


def compare(files: list[Path], mode: str = "llm42") -> list[str]:
    """One audit line per deterministic ratio that every file has a ``mode`` run at."""
    by_file = [[r for r in json.loads(f.read_text())["runs"]
                if r["mode"] == mode and r.get("det_digests")] for f in files]
    ratios = set.intersection(*({r["deterministic_ratio"] for r in runs} for runs in by_file))
    lines = []
    for ratio in sorted(ratios):
        runs: list[dict[str, Any]] = [r for runs in by_file for r in runs
                                      if r["deterministic_ratio"] == ratio]
        lines += [f"{mode} at {ratio:.0%}: {line}" for line in audit_lines(runs)]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="bench_offline --out JSON files")
    p.add_argument("--mode", default="llm42", help="the runs compared (default: llm42)")
    args = p.parse_args(argv)
    if len(args.files) < 2:
        p.error("give at least two files")
    lines = compare(args.files, args.mode)
    if not lines:
        p.error(f"no deterministic ratio with {args.mode} runs in every file")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
