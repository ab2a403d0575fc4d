"""An OpenAI HTTP target whose requests are sent from several client processes.

One Python process that streams every token of a hundred responses spends its CPU round
robin on them, and every send and every chunk it reads comes late: the client, not the
server, then shapes the latencies (docs/benchmarks/gpu/README.md measured it on the served
path). Here each of ``procs`` worker processes (spawned once, kept for every replay) sends
every ``procs``-th request of a replay at its arrival offset from a common start instant,
and the results come back in the order given. Counters (``server_stats``) are read from
this process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from loadgen.targets.base import OnDone, ReplayOptions, RequestResult, Target
from loadgen.targets.openai_http import OpenAIHTTPTarget
from loadgen.trace import TraceRequest

_LEAD_S = 0.05   # between handing out the shares and the common start


class ShardedHTTPTarget(Target):
    def __init__(self, base_url: str, procs: int, **http_args: Any) -> None:
        if procs < 1:
            raise ValueError("procs must be >= 1")
        self.procs = procs
        self._http_args = {"base_url": base_url, **http_args}
        self._local = OpenAIHTTPTarget(base_url, **http_args)
        self.label = self._local.label
        self.tokenizer = self._local.tokenizer
        self._pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
        # start the workers now (imports included), so a replay's lead time stays short
        for f in [self._pool.submit(_ready) for _ in range(procs)]:
            f.result()

    async def replay(self, requests: Sequence[TraceRequest], opts: ReplayOptions,
                     on_done: OnDone | None = None) -> list[RequestResult]:
        """Shares of ``requests`` (every ``procs``-th) replayed by the workers from one
        start instant; ``start_s`` is measured from that instant in every share."""
        args = {**self._http_args, "model": await self._local.resolve_model(),
                "label": self.label}
        if opts.max_concurrency is not None:   # the cap is shared out among the workers
            opts = ReplayOptions(-(-opts.max_concurrency // self.procs), opts.request_timeout_s,
                                 opts.deadline_s)
        loop = asyncio.get_running_loop()
        start_at = time.time() + _LEAD_S
        shares = [list(requests[i::self.procs]) for i in range(self.procs)]
        futures = [loop.run_in_executor(self._pool, _replay_share, args,
                                        [r.to_json() for r in share], start_at, opts)
                   for share in shares if share]
        parts = await asyncio.gather(*futures)
        by_id = {d["request_id"]: RequestResult.from_json(d) for part in parts for d in part}
        results = [by_id[r.id] for r in requests]
        if on_done is not None:
            for res in results:
                on_done(res)
        return results

    async def server_stats(self) -> dict[str, float]:
        return await self._local.server_stats()

    async def aclose(self) -> None:
        await self._local.aclose()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _ready() -> bool:
    """Runs once in each worker: the HTTP client's imports done before any replay."""
    import httpx  # noqa: F401

    return True


def _replay_share(http_args: dict[str, Any], requests: list[dict[str, Any]], start_at: float,
                  opts: ReplayOptions) -> list[dict[str, Any]]:
    """In a worker: replay one share from the wall-clock instant ``start_at``."""
    return asyncio.run(_share(http_args, requests, start_at, opts))


async def _share(http_args: dict[str, Any], requests: list[dict[str, Any]], start_at: float,
                 opts: ReplayOptions) -> list[dict[str, Any]]:
    args = dict(http_args)
    target = OpenAIHTTPTarget(args.pop("base_url"), **args)
    reqs = [TraceRequest.from_json(d) for d in requests]
    target.connect()   # the HTTP client (its TLS context) is built before the start
    wait = start_at - time.time()
    if wait > 0:
        await asyncio.sleep(wait)
    late = max(0.0, time.time() - start_at)   # offsets stay measured from start_at
    reqs = [r.with_(arrival_s=max(0.0, r.arrival_s - late)) for r in reqs]
    if opts.deadline_s is not None:
        opts = ReplayOptions(opts.max_concurrency, opts.request_timeout_s,
                             max(1e-3, opts.deadline_s - late))
    try:
        results = await target.replay(reqs, opts)
    finally:
        await target.aclose()
    out = []
    for r in results:
        r.start_s += late
        out.append(r.to_json())
    return out
