"""Host-to-device copies that do not wait for the device.

A copy from ordinary (pageable) host memory may wait for everything queued on the stream
before it, which would undo asynchronous scheduling: the next step's inputs could not be
uploaded while the current step runs. On CUDA the values go through pinned memory (PyTorch's
caching host allocator keeps a block until its copy has run) and are copied
``non_blocking``; on CPU this is a plain tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def upload(values: Sequence[int] | Sequence[Sequence[int]] | Tensor, device: torch.device | str,
           dtype: torch.dtype = torch.long) -> Tensor:
    """``values`` (ints, nested lists of ints, or a CPU tensor) as a tensor on ``device``."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return values.to(dtype) if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if isinstance(values, Tensor):
        host = values.to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(dev, non_blocking=True)
