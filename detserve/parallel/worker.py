"""A tensor-parallel worker process (rank >= 1): loads and shards the checkpoint, builds
its runner and KV pool (its own K/V heads only), then runs whatever rank 0 sends, in order,
until told to stop or until rank 0 is gone (``executor`` describes the protocol)."""

from __future__ import annotations

import multiprocessing.connection
import traceback

import torch

from detserve.distributed import Group, PeerLost, new_group, open_store
from detserve.executor.kv_pool import KVPool
from detserve.executor.runner import ModelRunner
from detserve.model.loader import load_model
from detserve.parallel.layout import TPLayout
from detserve.parallel.messages import (
    STARTUP_TIMEOUT_S,
    BatchStep,
    EnableGraphs,
    LaneStep,
    Start,
    Stop,
    WorkerSpec,
)
from detserve.parallel.shard import shard_model


def worker_main(pipe: multiprocessing.connection.Connection, spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.threads)
    c, device = spec.config, spec.device
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        store = open_store(spec.host, spec.port, server=False, timeout_s=STARTUP_TIMEOUT_S)
        pipe.send("joining")
        # (gloo applies the group's timeout to every operation: the steps' deadline)
        group = new_group(store, spec.group, spec.rank, c.tensor_parallel_size, device,
                          timeout_s=c.tp_timeout_s)
        whole, _, _ = load_model(c.model, dtype=c.dtype, device=device)
        layout = TPLayout(whole.config, c.tensor_parallel_size, spec.rank)
        model = shard_model(whole, layout, group, tree=c.tp_invariant_lane)
        del whole
        mc, cc = model.config, c.cache
        pool = KVPool(mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads,
                      mc.head_dim, model.dtype, device)
        start = pipe.recv()
        if not isinstance(start, Start):
            raise RuntimeError(f"expected Start, got {type(start).__name__}")
        runner = ModelRunner(model, pool, start.numerics, start.alignment)
        pipe.send("ready")
    except (EOFError, PeerLost):
        return
    except Exception:  # reported to rank 0, which fails the engine's start
        _report(pipe, traceback.format_exc())
        return
    serve(pipe, runner, group)


def serve(pipe: multiprocessing.connection.Connection, runner: ModelRunner,
          group: Group) -> None:
    """Run rank 0's steps in order; return when told to stop or when rank 0 is gone."""
    while True:
        try:
            msg = pipe.recv()
        except (EOFError, OSError):
            return
        try:
            if isinstance(msg, BatchStep):
                feed = None
                if msg.feed is not None:  # rank 0's tokens, broadcast in stream order
                    fed = torch.empty(msg.feed.shape, dtype=getattr(torch, msg.feed.dtype),
                                      device=runner.device)
                    group.follow(group.broadcast(fed, 0))
                    feed = (fed, msg.feed.pairs)
                # queued, never read back: rank 0 reads the (identical) results and feeds
                # the next step's tokens by broadcast, so this host prepares the next step
                # while the device runs this one, as rank 0's does
                runner.launch_batch(msg.segments, msg.sample_specs, msg.batch_invariant,
                                    msg.align_decode, feed, msg.penalties, msg.prompt_rows)
            elif isinstance(msg, LaneStep):
                runner.launch_lane(msg.lane_pass)
            elif isinstance(msg, EnableGraphs):
                runner.enable_cuda_graphs(msg.decode, msg.lane, msg.max_batch, msg.max_blocks,
                                          msg.step_rows, msg.plain)
            elif isinstance(msg, Stop):
                return
            else:
                raise RuntimeError(f"unknown message {type(msg).__name__}")
        except PeerLost:
            return
        except Exception:
            _report(pipe, traceback.format_exc())
            return


def _report(pipe: multiprocessing.connection.Connection, text: str) -> None:
    try:
        pipe.send(text[-4000:])
    except OSError:
        pass
