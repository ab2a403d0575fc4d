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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from detserve.executor.ops import run_in_row_chunks

__all__ = ["Alignment", "auto_alignment", "decode_buckets", "equals_portable_kernel",
           "joint_classes", "lane_call_sizes",
           "probe_lane_one_calls", "plan_alignment", "plan_product_pads", "probe_sizes",
           "row_classes", "shared_chunk", "single_call_sizes",
           "smallest_at_least"]


# rows compared per probed size: where another algorithm's sums differ from one only in
# the low bits, a row's bf16 outputs show it only now and then (a 128-column product, one
# K/V head at K=8,192: about one row in ten on an H200), and a narrow product compared on
# one row was put in the lane chunk's class at sizes that roll its windows back
PROBE_ROWS = 128


def smallest_at_least(sizes: Iterable[int], n: int) -> int | None:
    """The first of the ascending ``sizes`` that is >= ``n`` (None: none is)."""
    return next((s for s in sizes if s >= n), None)


def decode_buckets(max_batch: int) -> list[int]:
    """The fast path's decode batch sizes before alignment (``plan_alignment`` may move
    them; ``graphs.DecodeGraphs`` captures them by default): 1, 2, 4, 8, then steps of 8 to
    64, of 16 to 128, of 32 beyond, and ``max_batch`` itself."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, 1025, 32)]
    out = [s for s in sizes if s < max_batch]
    return [*out, max_batch]


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The product as the model calls it (a bias can change cuBLAS's choice of algorithm)."""
    return F.linear(x, weight) if bias is None else F.linear(x, weight, bias)


def _rows_in_calls(x: Tensor, weight: Tensor, bias: Tensor | None, m: int,
                   rows: int) -> Tensor:
    """The first ``rows`` rows of ``x`` times ``weight``, each from a call of exactly ``m``
    rows: one call over ``x[:m]`` where ``m`` >= ``rows``, else calls over ``rows`` rows
    tiled by ``m`` (the last zero-padded), so every position of an ``m``-row call is seen."""
    if m >= rows:
        return _linear(x[:m], weight, bias)[:rows]
    return run_in_row_chunks(lambda c: _linear(c, weight, bias), x[:rows], m)


def row_classes(weight: Tensor, sizes: Sequence[int], seed: int = 0,
                bias: Tensor | None = None) -> list[list[int]]:
    """Group ``sizes`` (row counts M) by the bits ``F.linear`` gives ``PROBE_ROWS`` rows,
    each in a call of M rows (``_rows_in_calls``). Sizes in one class run the same
    arithmetic (one algorithm computes every row the same way; another one differs
    somewhere in some row's N outputs)."""
    if not sizes or min(sizes) < 1:
        raise ValueError("sizes must be >= 1")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max(*sizes, PROBE_ROWS), weight.shape[1], generator=gen)
    x = x.to(weight.device, weight.dtype)
    classes: list[tuple[Tensor, list[int]]] = []
    for m in sizes:
        rows = _rows_in_calls(x, weight, bias, m, PROBE_ROWS)
        for ref, members in classes:
            if torch.equal(ref, rows):
                members.append(m)
                break
        else:
            classes.append((rows, [m]))
    return [members for _, members in classes]


def single_call_sizes(weight: Tensor, chunk: int, max_rows: int, seed: int = 0,
                      bias: Tensor | None = None, head_rows: int = 0) -> frozenset[int]:
    """Row counts M in 1..``max_rows`` at which one ``F.linear`` call over M rows gives each
    of its first min(M, H) rows the bits the lane gives the same row, H = max(``chunk``,
    ``head_rows``) (the most decode rows a step pads to) and the lane running its products
    in calls of exactly ``chunk`` rows: M's algorithm is the chunk's. An eager step whose
    decode rows lead the batch can then run that product once over all its rows (prefill
    rows included) instead of padding the decode rows to their bucket and running the rest
    apart, and the decode rows still get the lane's bits (a wrong answer here would only
    roll windows back: the lane decides). Every M is probed (cuBLAS picks by the exact
    shape), below ``PROBE_ROWS`` on that many rows in calls of M; one host sync in all."""
    if chunk < 1 or max_rows < 1:
        raise ValueError("chunk and max_rows must be >= 1")
    head = max(chunk, head_rows)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max(max_rows, head, PROBE_ROWS), weight.shape[1], generator=gen)
    x = x.to(weight.device, weight.dtype)
    ref = run_in_row_chunks(lambda c: _linear(c, weight, bias), x[:max(head, PROBE_ROWS)],
                            chunk)
    same = torch.zeros(max_rows + 1, dtype=torch.bool, device=weight.device)
    for m in range(1, max_rows + 1):
        k = max(min(m, head), PROBE_ROWS)  # (small M: PROBE_ROWS rows in calls of M)
        same[m] = torch.eq(_rows_in_calls(x, weight, bias, m, k), ref[:k]).all()
    return frozenset(m for m, ok in enumerate(same.tolist()) if ok)


def lane_call_sizes(weight: Tensor, chunk: int, sizes: Iterable[int], seed: int = 0,
                    bias: Tensor | None = None) -> frozenset[int]:
    """The row counts M among ``sizes`` (other than ``chunk``) at which one ``F.linear``
    call over M rows gives *every* row the bits that calls of exactly ``chunk`` rows give it.
    The lane may then run M rows of such a product as one call: for M a multiple of the
    chunk, one weight read instead of M / ``chunk``; for any other M, without padding the
    rows up to the next multiple. Two inputs are probed (plain Gaussian rows, and rows whose
    magnitudes span several orders, as activations with outliers do): a different reduction
    order changes some of a row's N sums on either."""
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    cands = sorted(m for m in set(sizes) if m >= 1 and m != chunk)
    if not cands:
        return frozenset()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = weight.shape[1]
    plain = torch.randn(cands[-1], k, generator=gen)
    wide = torch.randn(cands[-1], k, generator=gen) * torch.exp(2 * torch.randn(cands[-1], 1, generator=gen))
    same = dict.fromkeys(cands, True)
    for x in (plain, wide):
        x = x.to(weight.device, weight.dtype)
        ref = run_in_row_chunks(lambda c: _linear(c, weight, bias), x, chunk)
        for m in cands:
            same[m] = same[m] and torch.equal(_linear(x[:m], weight, bias), ref[:m])
    return frozenset(m for m, ok in same.items() if ok)


def probe_lane_one_calls(weights: Sequence[Tensor], chunk: int, sizes: Iterable[int],
                   biases: Sequence[Tensor | None] = ()) -> dict[tuple[int, int], frozenset[int]]:
    """``lane_call_sizes`` of every weight, keyed by its shape (N, K); weights of one shape
    keep the sizes all of them allow (``biases[i]``: ``weights[i]``'s bias, default none)."""
    bias = list(biases) + [None] * (len(weights) - len(biases))
    sizes = list(sizes)
    out: dict[tuple[int, int], frozenset[int]] = {}
    for w, b in zip(weights, bias, strict=True):
        key = (int(w.shape[0]), int(w.shape[1]))
        got = lane_call_sizes(w, chunk, sizes, bias=b)
        out[key] = out[key] & got if key in out else got
    return {key: v for key, v in out.items() if v}


def joint_classes(per_weight: Iterable[Sequence[Sequence[int]]]) -> list[list[int]]:
    """Sizes grouped so that two sizes share a group iff they share a class for every
    weight (``per_weight``: each weight's ``row_classes`` over the same sizes), i.e. the
    same bits for every product of the model. Groups in order of first size."""
    keys: dict[int, list[int]] = {}
    for classes in per_weight:
        for i, cls in enumerate(classes):
            for m in cls:
                keys.setdefault(m, []).append(i)
    sizes = sorted(keys)
    joint: dict[tuple[int, ...], list[int]] = {}
    for m in sizes:
        joint.setdefault(tuple(keys[m]), []).append(m)
    return list(joint.values())


def probe_sizes(full_batch: int, lane_rows: int) -> list[int]:
    """Row counts probed: 1..16, then multiples of 8 up to the larger of the full decode
    batch and the lane, and both of those."""
    top = max(full_batch, lane_rows)
    return sorted({*range(1, 17), *range(24, top + 1, 8), full_batch, lane_rows})


@dataclass(frozen=True)
class Alignment:
    """How the fast path and the lane agree on their products.

    ``chunk``: the lane runs every product in calls of exactly this many rows.
    ``buckets``: the row counts the fast path pads its decode rows to (graphs are captured
    at these sizes, eager steps pad their decode rows' products to them); every bucket up to
    the first one that holds a full decode batch is in ``chunk``'s class, so a decode row
    gets the lane's bits from every product.
    """

    chunk: int
    buckets: tuple[int, ...]
    # per weight shape (N, K): the step sizes M at which one call gives the leading rows
    # the chunk's bits (``single_call_sizes``); eager steps run those products unsplit
    single_call: Mapping[tuple[int, int], frozenset[int]] = field(default_factory=dict)
    # per weight shape (N, K): {bucket: rows} where that product runs a bucket's rows padded
    # to more rows, the smallest member of its own class of the chunk that holds them, while
    # the other products run the bucket as it is (``plan_product_pads``)
    pads: Mapping[tuple[int, int], Mapping[int, int]] = field(default_factory=dict)
    # every product over ``chunk`` rows gave the bits of the Triton batch-invariant kernel
    # (``equals_portable_kernel``): the lane's bits then do not depend on cuBLAS's choices
    portable: bool = False

    def bucket(self, n: int) -> int | None:
        return smallest_at_least(self.buckets, n)


def equals_portable_kernel(weights: Sequence[Tensor], biases: Sequence[Tensor | None],
                           chunk: int, seed: int = 0) -> bool:
    """Whether cuBLAS's product over ``chunk`` rows gives every one of ``weights`` the bits
    of this project's Triton batch-invariant kernel, whose bits depend only on the
    architecture, the SM count and Triton (``numerics.device_kind``). cuBLAS picks its
    kernel per card, so the chunks where this holds differ between cards of one class
    (``benchmarks/probe_gemm_classes``; figures in docs/benchmarks/gpu). Where it holds,
    the lane's products give the same bits on every card of the class. Two reduction
    orders agree on a random product's every output only by being the same order, so one
    probe tells."""
    if not all(w.is_cuda for w in weights):
        return False  # (the Triton kernel runs on GPUs only)
    from detserve.kernels.batch_invariant import matmul_bi

    gen = torch.Generator(device="cpu").manual_seed(seed)
    for w, b in zip(weights, biases, strict=True):
        x = torch.randn(chunk, w.shape[1], generator=gen).to(w.device, w.dtype)
        if not torch.equal(_linear(x, w, b), matmul_bi(x, w, b)):
            return False
    return True


def plan_alignment(classes: Sequence[Sequence[int]], full_batch: int, lane_rows: int,
                   base_buckets: Sequence[int], chunk: int = 0,
                   portable: Callable[[int], bool] | None = None) -> Alignment:
    """Choose the class (and in it the lane chunk) from the joint ``classes``.

    A class must hold a size >= ``full_batch`` so every decode batch can be padded into it.
    Among those whose smallest member is at most twice ``full_batch`` (a decode step reads
    the weights once whatever its rows, so a product padded that far costs little, and
    ``plan_product_pads`` pads only the products that need it), the one whose lane pass
    reads each weight the fewest times wins: once where a member holds the whole pass, else
    once per call of its largest member; ties: the smallest member. Without such a class:
    the one with the smallest member, ties: fewer lane calls. The chunk is, where the
    class holds every multiple of a member up to the first that covers ``lane_rows``, the
    one of those members with the least padding, then the nearest half a pass (a pass up to
    half full runs half the rows; the lane runs a pass's multiple as one call where
    ``lane_call_sizes`` confirms it); else the member that covers ``lane_rows`` in the
    fewest calls, then with the least padding. A given ``chunk`` fixes the class instead.
    ``portable(c)``: whether chunk ``c`` gives the portable kernel's bits; given, only such
    chunks (and the classes holding one) are chosen from (ValueError: none is).
    Buckets: each of ``base_buckets`` (the plain captured sizes) rounded up to a member of
    the class, or kept where the class has none that large.
    """
    def calls(c: int) -> tuple[int, int]:
        n = -(-lane_rows // c)
        return n, n * c

    def reads(c: Sequence[int]) -> int:
        return calls(max(c))[0]

    if chunk:
        cls = next((list(c) for c in classes if chunk in c), [chunk])
    else:
        allowed = {m for c in classes for m in c if portable is None or portable(m)}
        if not allowed:
            raise ValueError("no lane chunk on this GPU gives the portable kernel's bits")
        candidates = [list(c) for c in classes if allowed & set(c)]
        feasible = [c for c in candidates if max(c) >= full_batch]
        near = [c for c in feasible if min(c) <= 2 * full_batch]
        if near:
            cls = min(near, key=lambda c: (reads(c), min(c)))
        else:
            pool = feasible or candidates
            cls = min(pool, key=lambda c: (min(c) if feasible else -len(c), calls(max(c))))
        held = set(cls)
        chains = [c for c in cls if c in allowed
                  and all(k * c in held for k in range(1, calls(c)[0] + 1))]
        chunk = (min(chains, key=lambda c: (calls(c)[1], abs(2 * c - lane_rows)))
                 if chains else min((c for c in cls if c in allowed), key=calls))
    members = sorted(cls)
    buckets = sorted({smallest_at_least(members, b) or b for b in base_buckets})
    return Alignment(chunk, tuple(buckets))


def plan_product_pads(per_weight: Sequence[Sequence[Sequence[int]]],
                      keys: Sequence[tuple[int, int]], plan: Alignment,
                      base_buckets: Sequence[int]) -> Alignment:
    """``plan`` (from the joint classes) with a decode bucket that only some products must
    pad kept at its plain size and those products padded on their own (``pads``), each to
    the smallest member of its own class of the chunk that holds the bucket
    (``per_weight[i]``: the ``row_classes`` of the weight of shape ``keys[i]``). A bucket
    that every product must pad is rounded up as a whole, as ``plan`` has it (one padded
    batch costs less than a copy of the rows per product)."""
    own: dict[tuple[int, int], set[int]] = {}
    for classes, key in zip(per_weight, keys, strict=True):
        cls = next((set(c) for c in classes if plan.chunk in c), {plan.chunk})
        own[key] = own[key] & cls if key in own else cls
    members = {key: sorted(v) for key, v in own.items()}
    joint = sorted(set.intersection(*own.values())) if own else [plan.chunk]
    buckets: set[int] = set()
    pads: dict[tuple[int, int], dict[int, int]] = {}
    for b in base_buckets:
        up = {key: smallest_at_least(m, b) for key, m in members.items()}
        need = {key: u for key, u in up.items() if u != b}
        if need and len(need) < len(up) and None not in up.values():
            buckets.add(b)
            for key, u in need.items():
                pads.setdefault(key, {})[b] = cast(int, u)
        else:
            buckets.add(smallest_at_least(joint, b) or b)
    return Alignment(plan.chunk, tuple(sorted(buckets)), plan.single_call, pads)


def auto_alignment(weights: Sequence[Tensor], full_batch: int, lane_rows: int,
                   chunk: int = 0, step_rows: Sequence[int] = (),
                   biases: Sequence[Tensor | None] = (), portable: bool = False) -> Alignment:
    """Probe the model's products on this GPU and plan the alignment for a fast path that
    decodes up to ``full_batch`` sequences next to a lane of ``lane_rows`` rows.
    ``biases[i]``: ``weights[i]``'s bias as the model adds it (default none).
    ``step_rows[i]`` (optional): the most rows an eager step sends through ``weights[i]``;
    the sizes up to it that may run as one call are probed too (``single_call_sizes``).
    ``portable``: the chunk must give the portable kernel's bits (``equals_portable_kernel``;
    ValueError where none does, or where the given ``chunk`` does not)."""
    bias = list(biases) + [None] * (len(weights) - len(biases))
    verdicts: dict[int, bool] = {}

    def gives_portable_bits(c: int) -> bool:
        if c not in verdicts:
            verdicts[c] = equals_portable_kernel(weights, bias, c)
        return verdicts[c]
    sizes = probe_sizes(full_batch, lane_rows)
    if chunk:
        sizes = sorted({*sizes, chunk})
    per_weight = [row_classes(w, sizes, bias=b) for w, b in zip(weights, bias, strict=True)]
    keys = [(int(w.shape[0]), int(w.shape[1])) for w in weights]
    base = decode_buckets(full_batch)
    if portable and chunk and not gives_portable_bits(chunk):
        raise ValueError(f"lane chunk {chunk} does not give the portable kernel's bits here")
    plan = plan_alignment(joint_classes(per_weight), full_batch, lane_rows, base, chunk,
                          gives_portable_bits if portable else None)
    plan = plan_product_pads(per_weight, keys, plan, base)
    single: dict[tuple[int, int], frozenset[int]] = {}
    for w, b, rows, key in zip(weights, bias, step_rows, keys, strict=False):
        if rows > 0:
            got = single_call_sizes(w, plan.chunk, rows, bias=b, head_rows=plan.buckets[-1])
            single[key] = single[key] & got if key in single else got
    return Alignment(plan.chunk, plan.buckets, single, plan.pads,
                     portable=gives_portable_bits(plan.chunk))


def shared_chunk(shapes: Iterable[tuple[int, int]], full_batch: int, lane_rows: int,
                 device: str | torch.device, dtype: torch.dtype,
                 biased: Iterable[tuple[int, int]] = ()) -> int:
    """The lane chunk planned (``plan_alignment``) from the joint row classes of products
    of the given (N, K) ``shapes`` (``biased``: those the model adds a bias to), probed on
    stand-in weights: a class follows the product's shape, not its values. Every engine
    that passes the same shapes and sizes gets the same chunk on this GPU, whatever its own
    shapes: the TP-invariant lane passes its tree's, which are the same at every TP size,
    so that its products run the same rows per call at each (the chunk planned from a
    rank's own shapes differed: 256 rows at TP 1 and 2, 176 at TP 4 for the 70B shape)."""
    sizes = probe_sizes(full_batch, lane_rows)
    with_bias = set(biased)
    gen = torch.Generator(device=device).manual_seed(0)
    per_weight = []
    for n, k in sorted(set(shapes)):
        w = torch.randn(n, k, generator=gen, device=device, dtype=dtype)
        b = (torch.randn(n, generator=gen, device=device, dtype=dtype)
             if (n, k) in with_bias else None)
        per_weight.append(row_classes(w, sizes, bias=b))
        del w, b
    plan = plan_alignment(joint_classes(per_weight), full_batch, lane_rows,
                          decode_buckets(full_batch))
    return plan.chunk
