"""Test helpers for the kernels: random paged caches and the interpreter subprocess.

Imports torch only (never triton), so a test module can decide how triton gets imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# True inside the TRITON_INTERPRET=1 subprocess that run_in_interpreter starts.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_interpreter() -> None:
    """Adapt Triton's CPU interpreter for these tests (idempotent; only under TRITON_INTERPRET).

    1. Scalars as loop bounds under numpy >= 2.4: Triton <= 3.6 converts its 1-element
       scalar arrays with ``int(array)``, which numpy 2.4 rejects (triton-lang/triton#9171,
       fixed upstream by #9172).
    2. Row-independent ``tl.dot``: numpy's BLAS runs different micro-kernels for different
       rows of one matrix, so a row's bits would depend on its place in the tile. A GPU's
       MMA does not do that (the GPU tests check it); computing each row as its own
       vector-matrix product models it, so the bitwise invariance tests mean the same here.
    """
    import numpy as np
    from triton.runtime import interpreter

    orig_patch = interpreter._patch_lang_tensor
    if getattr(orig_patch, "_detserve", False):
        return

    def patch_lang_tensor(tensor: object, scope: interpreter._LangPatchScope) -> None:
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._detserve = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor

    builder = interpreter.InterpreterBuilder
    orig_dot = builder.create_dot

    def create_dot(self: object, a: interpreter.TensorHandle, b: interpreter.TensorHandle,
                   d: interpreter.TensorHandle, *args: object) -> interpreter.TensorHandle:
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:
            return orig_dot(self, a, b, d, *args)
        rows = [np.matmul(a.data[i], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.stack(rows) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


def run_in_interpreter(test_file: str, timeout_s: float = 1800.0) -> None:
    """Run ``test_file``'s non-GPU tests in a fresh process under ``TRITON_INTERPRET=1``.

    Triton reads the variable when a kernel is decorated, i.e. at import, so the
    interpreter needs its own process; this keeps the variable out of every other test.
    Raises AssertionError with the child's output when a test fails.
    """
    root = Path(test_file).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
           str(Path(test_file).resolve())]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise AssertionError(f"interpreter tests failed (rc={r.returncode}):\n"
                             f"{r.stdout[-12000:]}\n{r.stderr[-4000:]}")


@dataclass
class PagedKV:
    k_cache: Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor
    block_tables: Tensor  # int32 [num_seqs, max_blocks]
    context_lens: Tensor  # int32 [num_seqs]


def random_kv(context_lens: list[int], num_kv_heads: int, head_dim: int, *,
              seed: int) -> list[tuple[Tensor, Tensor]]:
    """Dense fp32 (k, v) pairs [n, Hkv, D] per sequence, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, num_kv_heads, head_dim, generator=g),
             torch.randn(n, num_kv_heads, head_dim, generator=g)) for n in context_lens]


def paged_from_dense(
    seqs: list[tuple[Tensor, Tensor]],
    block_size: int,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    max_blocks: int | None = None,
) -> PagedKV:
    """Scatter dense per-sequence K/V into a paged cache, in blocks shuffled by ``seed``.

    Every slot not holding a valid token is NaN, and block 0 is a NaN block that pads the
    block tables: a kernel that reads one position too far produces NaN.
    """
    g = torch.Generator().manual_seed(seed)
    lens = [k.shape[0] for k, _ in seqs]
    need = [-(-n // block_size) for n in lens]
    width = max(max(need, default=1), 1) if max_blocks is None else max_blocks
    total = sum(need) + 1
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    hkv, d = (seqs[0][0].shape[1:] if seqs else (1, 16))
    k_cache = torch.full((total, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    for s, ((k, v), nb) in enumerate(zip(seqs, need, strict=True)):
        tables[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        pos = torch.arange(k.shape[0])
        blocks = tables[s].long()[pos // block_size]
        k_cache[blocks, pos % block_size] = k.to(dtype)
        v_cache[blocks, pos % block_size] = v.to(dtype)
    return PagedKV(k_cache.to(device), v_cache.to(device), tables.to(device),
                   torch.tensor(lens, dtype=torch.int32, device=device))


def make_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    max_blocks: int | None = None,
) -> PagedKV:
    """A paged cache of random K/V for sequences of the given lengths (see paged_from_dense)."""
    seqs = random_kv(context_lens, num_kv_heads, head_dim, seed=seed)
    return paged_from_dense(seqs, block_size, dtype=dtype, device=device, seed=seed + 1,
                            max_blocks=max_blocks)


def randn(*shape: int, dtype: torch.dtype, device: str | torch.device, seed: int,
          scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Equal bit patterns (NaN == NaN of the same payload; -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
