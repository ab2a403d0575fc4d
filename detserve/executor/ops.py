"""Reduction policies for the model's matrix products, norms and activations.

``TorchOps`` is the fast path: whatever reduction order the backend picks for the shape.
``FixedShapeOps(rows)`` runs every op on row chunks of exactly ``rows`` rows (the last one
zero-padded), so a row's result depends only on that row: with ``rows == G*W`` on a lane
pass it is the lane's arithmetic; with a small ``rows`` on any batch it is the
batch-invariant baseline (the SGLang/vLLM approach, here as a plain-torch reference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from detserve.model.llama import Ops


def _rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def silu_mul(gate_up: Tensor, out: Tensor | None = None) -> Tensor:
    """SiLU(gate) * up of ``gate_up`` = [gate | up], into ``out`` if given (same bits)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.mul(F.silu(gate), up, out=out)


def add_then_rmsnorm(ops: Ops, x: Tensor, delta: Tensor, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
    """The residual add before a norm as two steps: torch's add, then ``ops``' norm."""
    h = x + delta
    return h, ops.rmsnorm(h, weight, eps)


class TorchOps:
    name = "torch"

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.linear(x, weight, bias)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return _rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x: Tensor, delta: Tensor, weight: Tensor,
                    eps: float) -> tuple[Tensor, Tensor]:
        return add_then_rmsnorm(self, x, delta, weight, eps)

    def silu_mul(self, gate_up: Tensor, out: Tensor | None = None) -> Tensor:
        """Elementwise (a row's bits never depend on the batch), into ``out`` if given."""
        return silu_mul(gate_up, out=out)


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows`` rows (``x`` itself if it has as many)."""
    n = x.shape[0]
    return x if rows <= n else torch.cat([x, x.new_zeros((rows - n, *x.shape[1:]))])


def run_in_row_chunks(fn: Callable[[Tensor], Tensor], x: Tensor, rows: int) -> Tensor:
    """Apply ``fn`` to chunks of exactly ``rows`` rows of ``x`` (zero-padding the tail)."""
    n = x.shape[0]
    if n == rows:
        return fn(x)
    pad = (-n) % rows
    x = pad_rows(x, n + pad)
    outs = [fn(x[i:i + rows]) for i in range(0, n + pad, rows)]
    return torch.cat(outs)[:n]


def linear_in_row_chunks(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int,
                         one_call: Mapping[tuple[int, int], frozenset[int]]) -> Tensor:
    """``F.linear`` on chunks of exactly ``rows`` rows of ``x``, except where ``one_call``
    lists, for the weight's shape (N, K), a row count M from x's rows up to their chunks'
    (x's rows rounded up to a multiple of ``rows``): the smallest such M rows (x's, then
    zero rows) go through one call, which a probe found to give every row the chunks' bits
    (``gemm_classes.lane_call_sizes``), for one weight read and no more rows than needed."""
    n = x.shape[0]
    m = -(-n // rows) * rows
    fits = [s for s in one_call.get((weight.shape[0], weight.shape[1]), ()) if n <= s <= m]
    if fits:
        return F.linear(pad_rows(x, min(fits)), weight, bias)[:n]
    return run_in_row_chunks(lambda c: F.linear(c, weight, bias), x, rows)


class FixedShapeOps:
    def __init__(self, rows: int) -> None:
        if rows <= 0:
            raise ValueError("rows must be positive")
        self.rows = rows
        self.name = f"fixed{rows}"

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return run_in_row_chunks(lambda c: F.linear(c, weight, bias), x, self.rows)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return run_in_row_chunks(lambda c: _rmsnorm(c, weight, eps), x, self.rows)

    def add_rmsnorm(self, x: Tensor, delta: Tensor, weight: Tensor,
                    eps: float) -> tuple[Tensor, Tensor]:
        return add_then_rmsnorm(self, x, delta, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return run_in_row_chunks(silu_mul, gate_up, self.rows)
