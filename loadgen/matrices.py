"""Named experiment matrices: workloads x modes x deterministic ratios x QPS.

``paper-offline`` and ``paper-online`` are the LLM-42 paper's Section 5 grids (4096
requests per cell; Figure 10 / Table 4, and Figure 11 / Table 5). ``ci-tiny`` is small
enough for a 2-core CPU with a 135M model. A matrix can also be read from a JSON file with
the same fields (see ``MatrixSpec.from_json``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loadgen.datasets import DatasetSpec
from loadgen.results import RATIO_MODES

PAPER_RATIOS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
PAPER_MODES = ("nondeterministic", "batch_invariant", "llm42")


@dataclass(frozen=True)
class Workload:
    name: str
    dataset: DatasetSpec


@dataclass(frozen=True)
class Cell:
    workload: Workload
    mode: str
    ratio: float
    qps: float

    @property
    def slug(self) -> str:
        q = "inf" if math.isinf(self.qps) else f"{self.qps:g}"
        return f"{self.workload.name}__{self.mode}__r{self.ratio:g}__q{q}"


@dataclass(frozen=True)
class MatrixSpec:
    name: str
    workloads: tuple[Workload, ...]
    modes: tuple[str, ...] = PAPER_MODES
    ratios: tuple[float, ...] = PAPER_RATIOS
    qps: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    warmup: int = 0

    def cells(self) -> list[Cell]:
        """Every run of the matrix. Modes without selective determinism run once per
        workload and QPS: ``nondeterministic`` with ratio 0, the others with ratio 1."""
        out = []
        for w in self.workloads:
            for q in self.qps:
                for mode in self.modes:
                    ratios = self.ratios if mode in RATIO_MODES else (
                        (0.0,) if mode == "nondeterministic" else (1.0,))
                    out += [Cell(w, mode, r, q) for r in ratios]
        return out

    def scaled(self, *, num_requests: int | None = None, modes: tuple[str, ...] | None = None,
               ratios: tuple[float, ...] | None = None,
               qps: tuple[float, ...] | None = None) -> MatrixSpec:
        spec = self
        if num_requests is not None:
            spec = replace(spec, workloads=tuple(
                replace(w, dataset=replace(w.dataset, num_requests=num_requests))
                for w in spec.workloads))
        return replace(spec, modes=modes or spec.modes, ratios=ratios or spec.ratios,
                       qps=qps or spec.qps)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["qps"] = ["inf" if math.isinf(q) else q for q in self.qps]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MatrixSpec:
        workloads = tuple(Workload(w["name"], DatasetSpec(**w["dataset"]))
                          for w in d["workloads"])
        qps = tuple(math.inf if q in ("inf", None) else float(q) for q in d.get("qps", ["inf"]))
        rest: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()
                if k not in ("workloads", "qps")}
        return cls(workloads=workloads, qps=qps, **rest)


def _random(n: int, i: int, o: int) -> Workload:
    return Workload(f"in={i},out={o}", DatasetSpec("random", num_requests=n, input_len=i,
                                                  output_len=o))


_PAPER_N = 4096
MATRICES: dict[str, MatrixSpec] = {
    "paper-offline": MatrixSpec(
        "paper-offline",
        workloads=(Workload("ArXiv", DatasetSpec("arxiv-like", num_requests=_PAPER_N)),
                   Workload("ShareGPT", DatasetSpec("sharegpt", num_requests=_PAPER_N)))
        + tuple(_random(_PAPER_N, i, o) for i, o in
                ((512, 256), (1024, 256), (1024, 512), (2048, 256), (2048, 512), (4096, 512))),
    ),
    "paper-online": MatrixSpec(
        "paper-online",
        workloads=(Workload("ShareGPT", DatasetSpec("sharegpt", num_requests=_PAPER_N)),),
        qps=(12.0, 14.0, 16.0, 18.0),
    ),
    "ci-tiny": MatrixSpec(
        "ci-tiny",
        workloads=(Workload("in=16,out=8", DatasetSpec("random", num_requests=8, input_len=16,
                                                      output_len=8, range_ratio=0.5)),),
        modes=("nondeterministic", "llm42"), ratios=(0.5, 1.0), qps=(math.inf, 8.0),
        warmup=1,
    ),
}


def get_matrix(name_or_path: str) -> MatrixSpec:
    if name_or_path in MATRICES:
        return MATRICES[name_or_path]
    path = Path(name_or_path)
    if path.exists():
        return MatrixSpec.from_json(json.loads(path.read_text()))
    raise ValueError(f"unknown matrix {name_or_path!r}; named ones: {sorted(MATRICES)}")
