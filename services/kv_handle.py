"""Export the KV pool as a handle a co-located verifier process maps in place (no copies).

CPU: a POSIX shared-memory segment. The exporter creates it with
``multiprocessing.shared_memory.SharedMemory`` (unique name, zero-filled, and unlinked by
Python's resource tracker should the exporter die). Both sides then map it through
``torch.UntypedStorage.from_file`` on ``/dev/shm/<name>``, so the mapping belongs to the
tensor's storage and is unmapped only when the last tensor view dies: dropping a
``SharedMemory`` object while a tensor still points into it would leave a dangling pointer.
Where ``/dev/shm`` does not exist (not Linux), ``torch.frombuffer`` over the segment is used
and the mapping is kept for the life of the process.

CUDA (not testable on a CPU-only machine): the pool's storage is exported with
``UntypedStorage._share_cuda_()`` (what ``torch.multiprocessing`` sends for a CUDA tensor) and
opened with ``UntypedStorage._new_shared_cuda``. The device is identified by UUID, since a
verifier actor may see the same GPU under another index (CUDA_VISIBLE_DEVICES).

Every handle carries the decoder's epoch; the registry says which epoch is current, so a
restarted decoder's stale handles are refused before anything is mapped.
"""

from __future__ import annotations

import atexit
import base64
import json
import math
import os
import secrets
import socket
from dataclasses import asdict, dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any, cast

import torch
from torch import Tensor

KINDS = ("shm", "cuda_ipc")
_SHM_DIR = "/dev/shm"
_SHM_PREFIX = "dskv_"  # dskv_<owner pid>_<random>: lets a later exporter reap dead owners' pools
# Resources this process exported (released by release_kv / at exit) or had to keep mapped.
_OWNED_SHM: dict[str, shared_memory.SharedMemory] = {}
_OWNED_CUDA: dict[str, Tensor] = {}
_PINNED_OPENED: list[shared_memory.SharedMemory] = []


HOST_ID_ENV = "DETSERVE_HOST_ID"


def host_id() -> str:
    """This machine as the registry names it: the hostname, or ``DETSERVE_HOST_ID`` (two
    processes of one machine that must not share memory, as on two hosts)."""
    return os.environ.get(HOST_ID_ENV) or socket.gethostname()


def device_key(device: str) -> str:
    """What says two processes use the same device: "cpu", or the GPU's UUID (indexes
    differ between processes that see different CUDA_VISIBLE_DEVICES)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(dev).uuid)


@dataclass(frozen=True)
class KVHandle:
    """A reference to a decoder's KV pool tensor (not the data)."""

    kind: str                   # "shm" | "cuda_ipc"
    name: str                   # shm: segment name; cuda_ipc: JSON of the IPC handle
    shape: tuple[int, ...]
    dtype: str                  # torch dtype name, e.g. "float32"
    device: str                 # the exporter's device: "cpu" | "cuda:N"
    epoch: int
    decoder_id: str
    host: str = field(default_factory=lambda: host_id())  # maps only on this host

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV handle kind {self.kind!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.epoch < 0 or not self.decoder_id or not self.name:
            raise ValueError("a KV handle needs a name, a decoder id and an epoch >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def device_key(self) -> str:
        """``device_key`` of the exporter's device."""
        return "cpu" if self.kind == "shm" else str(json.loads(self.name)["device_uuid"])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVHandle:
        d = json.loads(text)
        d["shape"] = tuple(d["shape"])
        return cls(**d)


def export_kv(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device,
              decoder_id: str, epoch: int) -> tuple[Tensor, KVHandle]:
    """Allocate a zeroed KV pool tensor that other processes on this host can map.

    The exporting process owns it: ``release_kv(handle)`` (or process exit) frees it."""
    dev = torch.device(device)
    dtype_name = str(dtype).removeprefix("torch.")
    if dev.type == "cuda":
        tensor, name = _export_cuda(shape, dtype, dev)
        kind, dev_name = "cuda_ipc", f"cuda:{tensor.device.index}"
    elif dev.type == "cpu":
        tensor, name = _export_shm(shape, dtype)
        kind, dev_name = "shm", "cpu"
    else:
        raise ValueError(f"cannot export a KV pool on {dev}")
    handle = KVHandle(kind, name, tuple(shape), dtype_name, dev_name, epoch, decoder_id)
    return tensor, handle


def open_kv(handle: KVHandle) -> Tensor:
    """Map an exported pool read-write. The mapping lives as long as the returned tensor
    (or any view of it). Raises FileNotFoundError when the pool no longer exists and
    ValueError when it cannot be mapped from here (another host, wrong size)."""
    if handle.host != socket.gethostname():
        raise ValueError(f"KV pool of {handle.decoder_id} lives on host {handle.host!r}; "
                         "only a co-located verifier can map it")
    if handle.kind == "shm":
        return _open_shm(handle)
    return _open_cuda(handle)


def release_kv(handle: KVHandle) -> None:
    """Exporter side: unlink the segment / drop the CUDA pool. Mappings already open in
    other processes stay valid until they are dropped; new opens fail."""
    shm = _OWNED_SHM.pop(handle.name, None)
    if shm is not None:
        shm.unlink()
    _OWNED_CUDA.pop(handle.name, None)


class KVExporter:
    """``kv_storage`` callable for ``LLMEngine`` that remembers the handle it exported."""

    def __init__(self, decoder_id: str, epoch: int) -> None:
        self.decoder_id = decoder_id
        self.epoch = epoch
        self._handle: KVHandle | None = None

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Tensor:
        if self._handle is not None:
            raise RuntimeError("this exporter already exported a pool")
        tensor, self._handle = export_kv(shape, dtype, device, self.decoder_id, self.epoch)
        return tensor

    @property
    def handle(self) -> KVHandle:
        if self._handle is None:
            raise RuntimeError("no KV pool exported yet (the engine calls kv_storage first)")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            release_kv(self._handle)


# ---- shared memory ------------------------------------------------------------------
def reap_dead_pools() -> list[str]:
    """Unlink pools whose exporting process is gone (it was SIGKILLed, or exited through
    ``os._exit`` as Ray workers do, so neither ``release_kv`` nor atexit ran). Verifiers
    that still map one keep their mapping. Returns the names unlinked."""
    if not os.path.isdir(_SHM_DIR):
        return []
    reaped = []
    for name in os.listdir(_SHM_DIR):
        parts = name.split("_")
        if not name.startswith(_SHM_PREFIX) or len(parts) != 3 or not parts[1].isdigit():
            continue
        if _pid_alive(int(parts[1])):
            continue
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
            reaped.append(name)
        except FileNotFoundError:
            pass
    return reaped


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _export_shm(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, str]:
    reap_dead_pools()
    nbytes = math.prod(shape) * dtype.itemsize
    name = f"{_SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))  # zero-filled
    _OWNED_SHM[shm.name] = shm
    if os.path.isdir(_SHM_DIR):
        shm.close()  # the segment stays until unlinked; the tensor maps it on its own
        return _map_file(os.path.join(_SHM_DIR, shm.name), shape, dtype, nbytes), shm.name
    return _from_buffer(shm, shape, dtype), shm.name


def _open_shm(handle: KVHandle) -> Tensor:
    if os.path.isdir(_SHM_DIR):
        return _map_file(os.path.join(_SHM_DIR, handle.name), handle.shape,
                         handle.torch_dtype, handle.nbytes)
    shm = shared_memory.SharedMemory(name=handle.name)
    # Python < 3.13 registers attached segments with the resource tracker too, which would
    # unlink the exporter's segment when this process exits: only the exporter owns it.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    if shm.size < handle.nbytes:
        raise ValueError(f"segment {handle.name} has {shm.size} bytes, need {handle.nbytes}")
    _PINNED_OPENED.append(shm)
    return _from_buffer(shm, handle.shape, handle.torch_dtype)


def _map_file(path: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> Tensor:
    # from_file would create (or grow) a missing file: open it first, then map it through
    # the descriptor, so a segment unlinked meanwhile is never silently re-created.
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"{path} has {size} bytes, need {nbytes}")
        storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(
            f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes))
    finally:
        os.close(fd)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def _from_buffer(shm: shared_memory.SharedMemory, shape: tuple[int, ...],
                 dtype: torch.dtype) -> Tensor:
    # the SharedMemory object must outlive the tensor: callers keep it until process exit
    return torch.frombuffer(shm.buf, dtype=dtype, count=math.prod(shape)).view(shape)


# ---- CUDA IPC -----------------------------------------------------------------------
def _export_cuda(shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> tuple[Tensor, str]:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available: cannot export a CUDA KV pool")
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    (dev, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = tensor.untyped_storage()._share_cuda_()
    payload = {
        "device_uuid": str(torch.cuda.get_device_properties(dev).uuid),
        "handle": _b64(handle), "size": size, "offset": offset,
        "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": ref_offset,
        "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync),
    }
    name = json.dumps(payload, sort_keys=True)
    _OWNED_CUDA[name] = tensor  # the exporter keeps the pool alive while it is exported
    return tensor, name


def _open_cuda(handle: KVHandle) -> Tensor:
    if not torch.cuda.is_available():
        raise ValueError("CUDA is not available here: cannot map a CUDA KV pool")
    p = json.loads(handle.name)
    index = _local_device_index(p["device_uuid"])
    torch.cuda._lazy_init()
    storage: Any = torch.UntypedStorage._new_shared_cuda(
        index, _unb64(p["handle"]), p["size"], p["offset"], _unb64(p["ref_counter_handle"]),
        p["ref_counter_offset"], _unb64(p["event_handle"]), p["event_sync_required"])
    tensor = torch.empty(0, dtype=handle.torch_dtype, device=f"cuda:{index}")
    return tensor.set_(storage).view(handle.shape)


def _local_device_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ValueError(f"GPU {uuid} of the KV pool is not visible to this process")


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


@atexit.register
def _release_all() -> None:
    for shm in list(_OWNED_SHM.values()):
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
    _OWNED_SHM.clear()
    _OWNED_CUDA.clear()
