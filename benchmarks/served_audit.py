"""Determinism audit through `detserve serve` under load (issue 37), with a control.

SGLang's procedure (``loadgen.audit_prompts``: the *single* prompt at batch sizes 1..B, the
*mixed* prompts of different lengths and the *prefix* prompts sharing a prefix, in random
multisets), repeated for ``--runs`` rounds, so that every probed prompt (a *target*) is
sampled at least ``--runs`` times. Every request goes twice: as a deterministic request, and
as the non-deterministic *control* (``is_deterministic: false``) in the same round. All the
while a Poisson stream of non-deterministic background requests (``--background-qps``)
keeps the server's batches changing, and several rounds are in flight at once.

Per target the report counts distinct outputs (token ids) and distinct logprob vectors: the
deterministic copies must give one of each; the control shows whether drift is there to
catch on this server (if no control ever drifts, the audit could not have told).

    python -m benchmarks.served_audit --model /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --device cuda --dtype bfloat16 --runs 1000 --out results/served-audit.json
    python -m benchmarks.served_audit --target http://127.0.0.1:8000 --tokenizer smollm2 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from detserve.flags import add_flags, engine_options
from loadgen.audit import PromptTally, tally
from loadgen.audit_prompts import AuditConfig, AuditPlan, words_text
from loadgen.runner import jsonable
from loadgen.targets.base import RequestResult, StreamingTarget
from loadgen.targets.openai_http import OpenAIHTTPTarget
from loadgen.tokenizer import Tokenizer, load_tokenizer
from loadgen.trace import TraceRequest

CONTROL = "control/"


def audit_rounds(plan: AuditPlan, runs: int, max_batch: int, seed: int = 0,
                 control: bool = True) -> list[list[TraceRequest]]:
    """``runs`` rounds; round r holds the single prompt (r % max_batch) + 1 times and each
    mixed and prefix prompt 1 to 4 times, shuffled; with ``control``, each request once
    more as a non-deterministic copy tagged ``control/<probe>``. Every target gets at least
    ``runs`` deterministic samples."""
    if runs < 1 or max_batch < 1:
        raise ValueError("runs and max_batch must be >= 1")
    cfg = plan.cfg
    rng = random.Random(seed)
    prompts = {"single": plan.single_prompt,
               **{f"mixed/{k}": v for k, v in plan.mixed_prompts.items()},
               **{f"prefix/{k}": v for k, v in plan.prefix_prompts.items()}}
    lens = {k: len(plan.tok.encode(v)) for k, v in prompts.items()}
    rounds = []
    count = 0
    for r in range(runs):
        batch: list[TraceRequest] = []
        for probe, text in prompts.items():
            copies = r % max_batch + 1 if probe == "single" else rng.randint(1, 4)
            for _ in range(copies):
                for det in (True, False) if control else (True,):
                    count += 1
                    batch.append(TraceRequest(
                        id=f"a{count}", prompt=text, prompt_len=lens[probe],
                        output_len=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed,
                        is_deterministic=det, logprobs=cfg.logprobs,
                        tags={"probe": probe if det else CONTROL + probe}))
        rng.shuffle(batch)
        rounds.append(batch)
    return rounds


def summarize(by_probe: dict[str, list[RequestResult]]) -> dict[str, Any]:
    """Tallies of the deterministic targets and of their controls, and the verdicts."""
    det = {p: tally(rs) for p, rs in sorted(by_probe.items()) if not p.startswith(CONTROL)}
    ctl = {p[len(CONTROL):]: tally(rs) for p, rs in sorted(by_probe.items())
           if p.startswith(CONTROL)}

    def row(probe: str, t: PromptTally) -> dict[str, Any]:
        d = asdict(t)
        d["outputs"] = d["outputs"][:3]
        errors = Counter(r.error[:120] for r in by_probe[probe] if not r.success)
        return {**d, "deterministic": t.deterministic, "errors": dict(errors.most_common(3))}

    return {
        "targets": {p: row(p, t) for p, t in det.items()},
        "controls": {p: row(CONTROL + p, t) for p, t in ctl.items()},
        "passed": bool(det) and all(t.deterministic for t in det.values()),
        "min_samples": min((t.samples for t in det.values()), default=0),
        "control_drift_seen": any(t.unique > 1 or (t.unique_logprobs or 1) > 1
                                  for t in ctl.values()),
        "failed_requests": sum(t.failed for t in (*det.values(), *ctl.values())),
    }


async def run_rounds(target: StreamingTarget, rounds: Sequence[list[TraceRequest]],
                     tok: Tokenizer, *, in_flight: int, background_qps: float,
                     background_tokens: int, max_outstanding: int = 200, seed: int = 0,
                     max_seconds: float | None = None, retries: int = 3,
                     log_every: int = 100
                     ) -> tuple[dict[str, list[RequestResult]], dict[str, Any]]:
    """Replay the rounds, ``in_flight`` at a time, under Poisson background load, with at
    most ``max_outstanding`` requests open at once (keep it under the router's admission
    bound, 2 x max_num_seqs: a shed request is not audited); one the router sheds anyway
    (429) is sent again, up to ``retries`` times. Returns the results by probe and counts
    of what ran. Past ``max_seconds`` no further round starts (``min_samples`` then says
    how far it got)."""
    by_probe: dict[str, list[RequestResult]] = {}
    rounds_open = asyncio.Semaphore(in_flight)
    open_requests = asyncio.Semaphore(max_outstanding)
    done = asyncio.Event()
    t0 = time.perf_counter()
    background: list[asyncio.Task[RequestResult]] = []
    counts = {"rounds": 0, "rounds_not_run": 0, "shed_and_resent": 0}

    async def send(req: TraceRequest) -> RequestResult:
        attempt = 0
        while True:
            async with open_requests:
                try:
                    res = await asyncio.wait_for(target.generate(req, t0), 300.0)
                except asyncio.TimeoutError:
                    res = RequestResult(req.id, req.is_deterministic, req.prompt_len,
                                        error="timed out after 300 s")
            if not res.error.startswith("HTTP 429") or attempt >= retries:
                return res
            attempt += 1
            counts["shed_and_resent"] += 1
            await asyncio.sleep(1.0)

    async def one_round(batch: list[TraceRequest]) -> None:
        async with rounds_open:
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                counts["rounds_not_run"] += 1
                return
            results = await asyncio.gather(*(send(r) for r in batch))
        for req, res in zip(batch, results, strict=True):
            by_probe.setdefault(str(req.tags["probe"]), []).append(res)
        counts["rounds"] += 1
        if counts["rounds"] % log_every == 0:
            print(f"[audit {time.perf_counter() - t0:5.0f}s] {counts['rounds']}/{len(rounds)} "
                  "rounds", flush=True)

    async def load() -> None:
        rng = random.Random(seed)
        i = 0
        while background_qps > 0 and not done.is_set():
            await asyncio.sleep(rng.expovariate(background_qps))
            i += 1
            text = words_text(tok, rng.choice((32, 128, 512, 1024)), rng, "Note: ")
            req = TraceRequest(id=f"bg{i}", prompt=text, prompt_len=0,
                               output_len=background_tokens, temperature=rng.choice((0.0, 1.0)),
                               is_deterministic=False, ignore_eos=True)
            background.append(asyncio.create_task(send(req)))

    loader = asyncio.create_task(load())
    await asyncio.gather(*(one_round(b) for b in rounds))
    done.set()
    await loader
    bg = await asyncio.gather(*background)
    return by_probe, {**counts, "seconds": time.perf_counter() - t0,
                      "background_requests": len(bg),
                      "background_failed": sum(not r.success for r in bg)}


def profiles(by_probe: dict[str, list[RequestResult]]) -> list[Any]:
    seen: list[Any] = []
    for rs in by_probe.values():
        for r in rs:
            if r.determinism and r.determinism not in seen:
                seen.append(r.determinism)
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="audit a running server (else one is started)")
    # the served model's own flags, as `detserve serve` takes them
    engine = engine_options()
    add_flags(p, {k: engine[k] for k in ("model", "device", "dtype")})
    p.add_argument("--server-args", default="--max-num-seqs 128 --num-blocks 16384 "
                                             "--max-model-len 8192 --stream-interval 8",
                   help="more `detserve serve` flags (chunks of 8 tokens: the same tokens "
                        "and logprobs, an eighth of the client's work)")
    p.add_argument("--tokenizer", help="for the prompts (default: the model's)")
    p.add_argument("--runs", type=int, default=1000, help="rounds (samples per target)")
    p.add_argument("--max-batch", type=int, default=8, help="single prompt: 1..this")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--mixed-lens", default="16,96,400,2400",
                   help="the long one drifts without determinism (the control needs it)")
    p.add_argument("--prefix-lens", default="1,64,256,511")
    p.add_argument("--no-control", action="store_true")
    p.add_argument("--in-flight", type=int, default=4, help="rounds sent at once")
    p.add_argument("--max-outstanding", type=int, default=200,
                   help="requests open at once (under the router's 2 x max_num_seqs)")
    p.add_argument("--background-qps", type=float, default=8.0)
    p.add_argument("--background-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, help="start no round after this long")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    tok = load_tokenizer(a.tokenizer or a.model)
    cfg = AuditConfig(modes=("single", "mixed", "prefix"), max_tokens=a.max_tokens,
                      temperature=a.temperature,
                      mixed_lens=tuple(int(x) for x in a.mixed_lens.split(",")),
                      prefix_lens=tuple(int(x) for x in a.prefix_lens.split(",")))
    rounds = audit_rounds(AuditPlan(cfg, tok), a.runs, a.max_batch, a.seed, not a.no_control)
    print(f"{len(rounds)} rounds, {sum(map(len, rounds))} requests", flush=True)
    server_flags = ("--model", a.model, "--device", a.device, "--dtype", a.dtype,
                    "--mode", "llm42", *shlex.split(a.server_args),
                    *(("--mps",) if a.device.startswith("cuda") else ()))
    report = asyncio.run(_audit(a, tok, rounds, server_flags))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(jsonable(report), indent=1))
    for name, part in (("target", "targets"), ("control", "controls")):
        for probe, t in report[part].items():
            print(f"{name} {probe}: {t['samples']} samples, {t['unique']} unique outputs, "
                  f"{t['unique_logprobs']} unique logprob vectors, {t['failed']} failed"
                  + (f" {t['errors']}" if t["errors"] else ""))
    print(f"passed={report['passed']} control_drift_seen={report['control_drift_seen']} "
          f"min_samples={report['min_samples']} rounds={report['run']['rounds']} "
          f"not run={report['run']['rounds_not_run']} ({report['run']['seconds']:.0f} s)")
    return 0 if report["passed"] else 1


async def _audit(a: argparse.Namespace, tok: Tokenizer, rounds: list[list[TraceRequest]],
                 server_flags: Sequence[str]) -> dict[str, Any]:
    from benchmarks.campaign.server import ServeProcess

    proc = None
    url = a.target
    if url is None:
        proc = ServeProcess(server_flags, Path(a.out).with_suffix(".server.log")).start()
        url = proc.url
        print(f"server ready in {proc.startup_s:.0f} s", flush=True)
    target = OpenAIHTTPTarget(url, label=url)
    try:
        by_probe, run = await run_rounds(target, rounds, tok, in_flight=a.in_flight,
                                         background_qps=a.background_qps,
                                         background_tokens=a.background_tokens,
                                         max_outstanding=a.max_outstanding, seed=a.seed,
                                         max_seconds=a.max_seconds)
        stats = await target.server_stats()
    finally:
        await target.aclose()
        if proc is not None:
            proc.stop()
    return {"args": vars(a), "server_flags": list(server_flags), "run": run,
            "profiles": profiles(by_probe), "server_counters": stats, **summarize(by_probe)}


if __name__ == "__main__":
    sys.exit(main())
