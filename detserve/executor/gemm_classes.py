"""Which row counts give a matrix product the same bits: the lane's GEMM chunk size.

cuBLAS picks its algorithm (tile shape, split-K factor) from the problem shape, so a row's
result can change with the number of rows M of the call. Sizes that give identical bits
form *classes* (e.g. every M in 65..256 on one GPU). A lane pass that runs its products in
chunks of ``c`` rows reproduces, bit for bit, the fast path's products for every decode
batch padded to a size in c's class; when attention also matches (see
``gpu.fast_decode_attention``), the lane agrees with the fast path and the window commits.
Which chunk is chosen only moves how often windows roll back, never determinism: the lane
still runs a fixed shape, and the chunk is part of the determinism profile.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["auto_lane_gemm_rows", "choose_lane_gemm_rows", "row_classes"]



def row_classes(weight: Tensor, sizes: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Group ``sizes`` (row counts M) by the bits ``F.linear(x[:M], weight)`` gives its first
    row. Sizes in one class run the same arithmetic (one algorithm computes every row the
    same way; another one differs somewhere in the row's N outputs)."""
    if not sizes or min(sizes) < 1:
        raise ValueError("sizes must be >= 1")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max(sizes), weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    classes: list[tuple[Tensor, list[int]]] = []
    for m in sizes:
        row = F.linear(x[:m], weight)[0]
        for ref, members in classes:
            if torch.equal(ref, row):
                members.append(m)
                break
        else:
            classes.append((row, [m]))
    return [members for _, members in classes]


def choose_lane_gemm_rows(weights: Iterable[Tensor], buckets: Sequence[int], lane_rows: int,
                          extra: Sequence[int] = ()) -> int:
    """The lane's GEMM chunk.

    ``buckets`` are the row counts the fast path decodes at (its padded batch sizes).
    Sizes are grouped into joint classes (same bits for every weight); the class holding
    the most buckets wins (ties: the one holding the largest bucket), and the chunk is the
    member of that class (buckets or ``extra`` sizes) that covers ``lane_rows`` rows in the
    fewest calls, then with the least padding.
    """
    sizes = sorted(set(buckets) | set(extra))
    weights = list(weights)
    keys: dict[int, list[int]] = {m: [] for m in sizes}
    for w in weights:
        for i, cls in enumerate(row_classes(w, sizes)):
            for m in cls:
                keys[m].append(i)
    joint: dict[tuple[int, ...], list[int]] = {}
    for m in sizes:
        joint.setdefault(tuple(keys[m]), []).append(m)
    bucket_set = set(buckets)

    def score(members: list[int]) -> tuple[int, int]:
        held = [m for m in members if m in bucket_set]
        return len(held), max(held, default=0)

    best = max(joint.values(), key=score)
    return min(best, key=lambda c: (-(-lane_rows // c), -(-lane_rows // c) * c))


def auto_lane_gemm_rows(weights: Iterable[Tensor], full_batch: int, lane_rows: int,
                        cuda_graphs: bool) -> int:
    """``choose_lane_gemm_rows`` for a fast path decoding up to ``full_batch`` sequences:
    padded to the captured sizes with CUDA graphs, at any size without; larger captured
    sizes up to ``lane_rows`` are extra chunk candidates."""
    from detserve.executor.graphs import decode_buckets

    buckets = decode_buckets(full_batch) if cuda_graphs else list(range(1, full_batch + 1))
    extra = [m for m in decode_buckets(lane_rows) if m > full_batch]
    return choose_lane_gemm_rows(weights, buckets, lane_rows, extra)
