"""Do the rows a dedicated verifier sends back carry other bits than the decoder's pool held
there? A diagnostic for issue 35 (rollbacks only with a dedicated verifier, none co-located).

    python -m benchmarks.kv_pull_check <bench_offline arguments, with --modes llm42-dedicated>

Every pulled window row (a window's last committed token and its accepted candidates) was
written first by the decoder's fast path, when it decoded those candidates. With an
aligned fast path (CUDA) the two must be equal bit for bit: a co-located lane overwrites
them with its own bits before the rows decoded past the window read them (most of the
time), a dedicated one only once its reply is pulled. Each pull is compared with what the
pool held before (prompt rows are skipped: the decoder never wrote them), and read back
after it was written (did it land). Printed after each run:
- window rows pulled, and how many differed from the fast path's, by place in the window
  (its first row, its last, the others) and whether layer 0 differed too (the row's own
  inputs or products, rather than attention over earlier rows);
- rows that did not land where they were written.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch

from benchmarks import bench_offline
from detserve.lane import LanePass, LaneResult
from services.verifier.transfer import DecoderTransfer, committed

STATS: Counter[str] = Counter()


def install() -> Counter[str]:
    """Wrap ``DecoderTransfer.pull`` with the comparison; returns the counters it adds to."""
    pull = DecoderTransfer.pull

    def checked(self: DecoderTransfer, lane_pass: LanePass, result: LaneResult,
                kv_rows: int, write: bool = True) -> None:
        spans = committed(lane_pass, result)
        slots = self.pool.slots_of((s.block_table, s.start, e) for s, e in spans)
        if not (write and len(slots)):
            pull(self, lane_pass, result, kv_rows, write)
            return
        before = self.pool.read_rows(slots).clone()
        got: dict[str, torch.Tensor] = {}
        write_rows = self.pool.write_rows

        def keep(at: torch.Tensor, rows: torch.Tensor) -> None:
            got["rows"] = rows
            write_rows(at, rows)

        self.pool.write_rows = keep  # type: ignore[method-assign, assignment]
        try:
            pull(self, lane_pass, result, kv_rows, write)
        finally:
            del self.pool.write_rows
        after = self.pool.read_rows(slots)
        STATS["rows_not_landed"] += int((after != got["rows"]).flatten(3).any(-1)
                                        .any(0).any(0).sum())
        differs = (after != before).flatten(3).any(-1)  # [layers, 2, rows]
        row = differs.any(0).any(0).tolist()
        layer0 = differs[0].any(0).tolist()
        i = 0
        for s, end in spans:
            n = end - s.start
            if s.kind == "window":
                for j in range(n):
                    place = "first" if j == 0 else "last" if j == len(s.input_ids) - 1 else "mid"
                    STATS[f"window_rows_{place}"] += 1
                    if row[i + j]:
                        STATS[f"differ_{place}"] += 1
                        STATS["differ_layer0"] += layer0[i + j]
                STATS["windows"] += 1
                STATS["windows_with_a_differing_row"] += any(row[i:i + n])
            i += n

    DecoderTransfer.pull = checked  # type: ignore[method-assign]
    return STATS


def report(stats: Counter[str]) -> str:
    rows = sum(stats[f"window_rows_{p}"] for p in ("first", "mid", "last"))
    places = ", ".join(f"{p} {stats[f'differ_{p}']}/{stats[f'window_rows_{p}']}"
                       for p in ("first", "mid", "last"))
    return (f"pulled window rows that differ from the fast path's: "
            f"{sum(stats[f'differ_{p}'] for p in ('first', 'mid', 'last'))} of {rows} "
            f"({places}; layer 0 too: {stats['differ_layer0']}); windows with one: "
            f"{stats['windows_with_a_differing_row']} of {stats['windows']}; "
            f"rows that did not land: {stats['rows_not_landed']}")


def main(argv: list[str] | None = None) -> int:
    stats = install()
    run_one = bench_offline.run_one

    def counted(*args: Any, **kw: Any) -> dict[str, Any]:
        stats.clear()
        out = run_one(*args, **kw)
        if out.get("transfer"):
            print(f"{'':>16} {out['mode']} {out['deterministic_ratio']:.0%}: {report(stats)}",
                  flush=True)
        return out

    bench_offline.run_one = counted
    return bench_offline.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
