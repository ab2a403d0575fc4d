"""Reduction policies for the model's matrix products, norms and activations.

``TorchOps`` is the fast path: whatever reduction order the backend picks for the shape.
``FixedShapeOps(rows)`` runs every op on row chunks of exactly ``rows`` rows (the last one
zero-padded), so a row's result depends only on that row: with ``rows == G*W`` on a lane
pass it is the lane's arithmetic; with a small ``rows`` on any batch it is the
batch-invariant baseline (the SGLang/vLLM approach, here as a plain-torch reference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor


def _rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def _silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchOps:
    name = "torch"

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.linear(x, weight, bias)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return _rmsnorm(x, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return _silu_mul(gate_up)


def run_in_row_chunks(fn: Callable[[Tensor], Tensor], x: Tensor, rows: int) -> Tensor:
    """Apply ``fn`` to chunks of exactly ``rows`` rows of ``x`` (zero-padding the tail)."""
    n = x.shape[0]
    if n == rows:
        return fn(x)
    pad = (-n) % rows
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    outs = [fn(x[i:i + rows]) for i in range(0, n + pad, rows)]
    return torch.cat(outs)[:n]


def linear_in_row_chunks(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int,
                         one_call: Mapping[tuple[int, int], frozenset[int]]) -> Tensor:
    """``F.linear`` on chunks of exactly ``rows`` rows of ``x``, except that where
    ``one_call`` lists, for the weight's shape (N, K), the padded row count M (a multiple of
    ``rows``), the M rows go through one call: a probe found that call to give every row the
    chunks' bits (``gemm_classes.lane_call_sizes``), for the price of one weight read."""
    n = x.shape[0]
    m = -(-n // rows) * rows
    if m > rows and m in one_call.get((weight.shape[0], weight.shape[1]), ()):
        if m > n:
            x = torch.cat([x, x.new_zeros((m - n, *x.shape[1:]))])
        return F.linear(x, weight, bias)[:n]
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

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return run_in_row_chunks(_silu_mul, gate_up, self.rows)
