"""The TP group's all-reduce for small tensors on CUDA: each rank's partial goes into a
buffer that every rank maps (torch's symmetric memory), and one kernel on each rank loads
all ranks' partials and adds them in rank order. A decode step's row-parallel sums (64 a
step for an 8B model, each a few hundred KB) are latency-bound, and one kernel without a
protocol finishes sooner than NCCL's all-reduce (docs/tensor-parallel.md, "On CUDA").

Bits: the kernel adds ``((p0 + p1) + p2) + ...`` in the tensor's dtype, the same on every
rank. At two ranks that is ``p0 + p1``: the bits of every other way of summing two partials
(NCCL's all-reduce, the lane's gathered sum, the invariant tree's top), so it stands in
for all of them. At more ranks it is used only where no bits are promised (the fast
path's plain sums).

Where symmetric memory cannot be set up (no peer access, a torch without it, an
unsupported dtype), ``PeerSum.open`` returns None and the group's NCCL collectives stay.
So it does where any member already made peer sums for an earlier engine: a second TP
engine in one process, whose workers were new processes, hung at its first steps with
them, while the first engine of each process ran (measured on two H200s).

A dead peer leaves the kernel waiting for its signal (it has no abort, unlike NCCL's):
the step's read-back deadline still fails the engine (``executor.Workers``).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from detserve.distributed import Group

log = logging.getLogger(__name__)

# the largest tensor summed by peer loads: a 512-row pass of an 8B model's hidden size in
# bf16 (decode steps and lane passes); larger ones (prefill chunks) go to NCCL, whose ring
# moves less data per rank at more than two ranks
PEER_SUM_BYTES = 4 << 20
DTYPES = (torch.bfloat16, torch.float32)  # what the kernel adds
_OPENED = False  # this process made peer sums already (for an earlier engine)


class PeerSum:
    """Sums a TP group's partials by peer loads (see the module's docstring)."""

    def __init__(self, group: Group, name: str, buffer: Tensor) -> None:
        self.group, self.name, self.buffer = group, name, buffer

    @classmethod
    def open(cls, group: Group, store: dist.Store, name: str, dtype: torch.dtype,
             fresh: bool = True) -> PeerSum | None:
        """Every member calls this after the group is connected, on the thread of its
        NCCL work, in the same order of groups; ``fresh``: no earlier engine of this
        process made peer sums. None: the group keeps NCCL (the reason is logged); every
        member then gets None, since the checks are collectives."""
        if group.backend != "nccl" or dtype not in DTYPES or group.size < 2:
            return None
        if not _all(group, fresh):
            log.info("peer-load sums off for %s: a member's process made them for an "
                     "earlier engine (NCCL all-reduce)", name)
            return None
        try:
            made: PeerSum | None = cls._make(group, store, name, dtype)
        except (RuntimeError, AttributeError, ImportError, ValueError) as e:
            log.warning("peer-load sums unavailable for %s (%s): NCCL all-reduce", name, e)
            made = None
        return made if _all(group, made is not None) else None  # all members, or none

    @classmethod
    def _make(cls, group: Group, store: dist.Store, name: str, dtype: torch.dtype) -> PeerSum:
        import torch.distributed._symmetric_memory as symm
        from torch._C._distributed_c10d import _SymmetricMemory

        ops: Any = torch.ops.symm_mem
        if not hasattr(ops, "one_shot_all_reduce_out"):
            raise AttributeError("torch has no one_shot_all_reduce_out")
        from torch._C._distributed_c10d import ProcessGroup, _register_process_group

        key = f"detserve-peer-sum/{name}"
        prefixed = dist.PrefixStore(key + "/", store)
        # symmetric memory finds its group by name: the group, wrapped and registered
        # under that name (never as a default group)
        wrapper = ProcessGroup(prefixed, group.rank, group.size)
        wrapper._register_backend(group.device, ProcessGroup.BackendType.NCCL, group.pg)
        wrapper._set_default_backend(ProcessGroup.BackendType.NCCL)
        wrapper._set_group_name(cast(Any, key))
        _register_process_group(cast(Any, key), wrapper)
        if hasattr(_SymmetricMemory, "set_group_info"):  # (torch versions that ask for it)
            _SymmetricMemory.set_group_info(key, group.rank, group.size, prefixed)
        numel = PEER_SUM_BYTES // torch.finfo(dtype).bits * 8
        buffer = symm.empty(numel, dtype=dtype, device=group.device)
        symm.rendezvous(buffer, cast(Any, key))
        made = cls(group, key, buffer)
        made._check()
        return made

    def _check(self) -> None:
        """One sum checked before it is trusted: each rank contributes rank + 1."""
        t = torch.full((4096,), float(self.group.rank + 1), dtype=self.buffer.dtype,
                       device=self.group.device)
        got = self(t)
        want = float(self.group.size * (self.group.size + 1) // 2)
        torch.cuda.synchronize(self.group.device)
        if got is None or not bool((got == want).all()):
            raise RuntimeError("the peer-load sum gave a wrong result")

    def fits(self, t: Tensor) -> bool:
        return t.dtype == self.buffer.dtype and t.numel() <= self.buffer.numel()

    def __call__(self, t: Tensor) -> Tensor | None:
        """The sum of every rank's ``t`` (same shape on each), or None: too large or of
        another dtype (the caller uses NCCL)."""
        if not self.fits(t):
            return None
        t = t.contiguous()
        out = torch.empty_like(t)
        shared = self.buffer[:t.numel()].view(t.shape)
        ops: Any = torch.ops.symm_mem
        if hasattr(ops, "one_shot_all_reduce_copy_out"):  # the copy in, inside the kernel
            ops.one_shot_all_reduce_copy_out(shared, t, "sum", self.name, out)
        else:
            shared.copy_(t)
            ops.one_shot_all_reduce_out(shared, "sum", self.name, out)
        return out


def _all(group: Group, mine: bool) -> bool:
    """Whether ``mine`` holds on every member of ``group`` (a collective)."""
    flag = torch.tensor([1.0 if mine else 0.0], device=group.device)
    group.wait(group.all_reduce(flag))
    return int(flag.item()) == group.size


def open_peer_sums(store: dist.Store, groups: dict[str, Group],
                   dtype: torch.dtype) -> list[PeerSum]:
    """``PeerSum.open`` for each of one engine's ``groups`` (name -> group, in the same
    order on every member), those that opened."""
    global _OPENED
    fresh, _OPENED = not _OPENED, True
    return [p for name, g in groups.items()
            if (p := PeerSum.open(g, store, name, dtype, fresh)) is not None]
