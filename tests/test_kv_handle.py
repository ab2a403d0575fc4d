"""KV pool export/map: shared memory on CPU (across processes), CUDA IPC on GPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
from dataclasses import replace

import pytest
import torch

from services.kv_handle import (
    KVExporter,
    KVHandle,
    export_kv,
    open_kv,
    reap_dead_pools,
    release_kv,
)

SHAPE = (2, 2, 5, 4, 2, 8)


def _child_write(handle_json: str, value: float) -> None:
    """Runs in a spawned process: map the pool, write, and exit (unmapping it)."""
    t = open_kv(KVHandle.from_json(handle_json))
    t[1, 0, 3] = value
    t[0, 1, 4, 3, 1, 7] = value + 1


def test_roundtrip_same_process() -> None:
    tensor, handle = export_kv(SHAPE, torch.bfloat16, "cpu", "dec-a", 3)
    try:
        assert tensor.shape == SHAPE and tensor.dtype == torch.bfloat16
        assert not tensor.any(), "a new pool is zero-filled"
        assert handle.kind == "shm" and handle.epoch == 3 and handle.decoder_id == "dec-a"
        assert KVHandle.from_json(handle.to_json()) == handle
        view = open_kv(handle)
        tensor[1, 1, 2] = 2.5
        assert torch.equal(view, tensor)
        view[0, 0, 0, 0] = -1.0
        assert tensor[0, 0, 0, 0].eq(-1.0).all()
    finally:
        release_kv(handle)
    with pytest.raises(FileNotFoundError):
        open_kv(handle)
    tensor.add_(1)  # the exporter's mapping outlives the unlinked segment


def test_another_process_writes_in_place_and_does_not_unlink() -> None:
    tensor, handle = export_kv(SHAPE, torch.float32, "cpu", "dec-b", 1)
    try:
        proc = mp.get_context("spawn").Process(target=_child_write, args=(handle.to_json(), 7.0))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        assert tensor[1, 0, 3].eq(7.0).all()
        assert tensor[0, 1, 4, 3, 1, 7].item() == 8.0
        assert tensor.sum().item() == 7.0 * 4 * 2 * 8 + 8.0
        # the child's resource tracker must not have unlinked the exporter's segment
        assert torch.equal(open_kv(handle), tensor)
    finally:
        release_kv(handle)


def test_refuses_what_cannot_be_mapped_here() -> None:
    tensor, handle = export_kv(SHAPE, torch.float32, "cpu", "dec-c", 1)
    try:
        with pytest.raises(ValueError, match="co-located"):
            open_kv(replace(handle, host="elsewhere"))
        with pytest.raises(ValueError, match="bytes"):
            open_kv(replace(handle, shape=(4, *SHAPE[1:])))
        with pytest.raises(FileNotFoundError):
            open_kv(replace(handle, name="detserve-no-such-segment"))
        assert not os.path.exists("/dev/shm/detserve-no-such-segment"), "must not create"
    finally:
        release_kv(handle)
    with pytest.raises(ValueError):
        KVHandle("nccl", "x", SHAPE, "float32", "cpu", 0, "d")
    with pytest.raises(ValueError):
        KVHandle("shm", "x", SHAPE, "float33", "cpu", 0, "d")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_pools_of_dead_exporters_are_reaped() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: a pool named after it has no live owner
    orphan = f"/dev/shm/dskv_{dead.pid}_0badf00d"
    with open(orphan, "wb") as f:
        f.write(b"\0" * 64)
    tensor, handle = export_kv(SHAPE, torch.float32, "cpu", "dec-r", 1)
    try:
        assert not os.path.exists(orphan), "exporting reaps dead owners' pools"
        assert handle.name.startswith(f"dskv_{os.getpid()}_")
        assert handle.name not in reap_dead_pools(), "a live owner's pool stays"
        assert torch.equal(open_kv(handle), tensor)
    finally:
        release_kv(handle)


def test_exporter_is_the_engine_kv_storage() -> None:
    from engine_utils import tiny_model

    from detserve.engine import LLMEngine
    from detserve.params import SamplingParams

    exporter = KVExporter("dec-e", 5)
    with pytest.raises(RuntimeError):
        _ = exporter.handle
    engine = LLMEngine.from_args(tiny_model(), "llm42", verify_window=4, verify_group=2,
                                 max_model_len=128, num_blocks=16)
    plain = engine.pool.data
    engine = LLMEngine(engine.config, kv_storage=exporter,
                       loaded=(engine.model, engine.tokenizer, engine.model_info))
    try:
        assert exporter.handle.shape == tuple(plain.shape)
        engine.add_request("a", None, SamplingParams(max_tokens=4), prompt_token_ids=[5, 6, 7])
        while engine.has_unfinished_requests():
            engine.step()
        assert open_kv(exporter.handle).abs().sum() > 0, "the engine wrote into the export"
    finally:
        exporter.close()


def _child_cuda(handle_json: str) -> None:
    t = open_kv(KVHandle.from_json(handle_json))
    t[0, 1] += 3
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_ipc_roundtrip() -> None:
    tensor, handle = export_kv(SHAPE, torch.bfloat16, "cuda:0", "dec-g", 2)
    assert handle.kind == "cuda_ipc" and tensor.is_cuda
    tensor.fill_(1)
    torch.cuda.synchronize()
    proc = mp.get_context("spawn").Process(target=_child_cuda, args=(handle.to_json(),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    assert tensor[0, 1].eq(4).all() and tensor[0, 0].eq(1).all()
    release_kv(handle)
