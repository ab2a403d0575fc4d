"""Deterministic outputs of fixed requests, saved so that two builds can be compared bit
for bit (tokens, logprob bits, fingerprint).

Targets (greedy and seeded sampling, with logprobs) run as deterministic requests among
random co-runners that arrive over several steps, in ``llm42`` mode (and in
``batch_invariant`` with ``--modes``). Only the engine's public API is used (``EngineConfig``,
``LLMEngine.add_request/step``), so the same script runs against an earlier tree:

    PYTHONPATH=<earlier tree> python benchmarks/det_outputs.py --model random:llama3-8b \
        --device cuda --dtype bfloat16 --out before.json
    python benchmarks/det_outputs.py ... --out after.json
    python benchmarks/det_outputs.py --compare before.json after.json

Across GPU models (issue 37): record the same requests on each machine, several models in
one file (keys ``<model>|<mode>``), with the device and library versions beside each
record, then compare request by request (``--report`` writes the verdict as JSON):

    python benchmarks/det_outputs.py --models random:llama3-8b,$SMOLLM2 --out h100.json
    python benchmarks/det_outputs.py --models random:llama3-8b,$SMOLLM2 --out h200.json
    python benchmarks/det_outputs.py --compare h100.json h200.json --report cross-gpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

from detserve.flags import add_flags, engine_kwargs, engine_options


def environment(device: str) -> dict[str, Any]:
    """The machine a record was made on: what could change a kernel's bits."""
    import platform

    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "host": platform.node()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(device=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1),
                   blas=str(torch.backends.cuda.preferred_blas_library()),
                   cudnn=torch.backends.cudnn.version())
    else:
        env["device"] = f"cpu-{platform.machine()}"
    return env


def _signature(o: Any) -> dict[str, Any]:
    return {"token_ids": list(o.token_ids),
            "logprobs": [lp.logprob.hex() for lp in o.logprobs or []]}


def run_mode(model: str, mode: str, device: str, dtype: str, max_tokens: int,
             seed: int, **options: Any) -> dict[str, Any]:
    from detserve.config import EngineConfig
    from detserve.engine import LLMEngine
    from detserve.params import SamplingParams

    cfg = EngineConfig.create(model, mode, device=device, dtype=dtype, max_num_seqs=128,
                              max_model_len=4096, num_blocks=8192, seed=seed, **options)
    engine = LLMEngine(cfg)
    vocab = engine.model.config.vocab_size
    rng = random.Random(seed)
    targets = [[rng.randrange(3, vocab) for _ in range(n)] for n in (12, 45, 90, 150, 600)]
    reqs: list[tuple[str, list[int], Any]] = []
    for i, t in enumerate(targets):
        sampled = i % 2 == 1
        reqs.append((f"t{i}", t, SamplingParams(
            max_tokens=max_tokens, temperature=0.8 if sampled else 0.0,
            top_p=0.9 if sampled else 1.0, seed=1000 + i if sampled else None,
            is_deterministic=True, logprobs=1, ignore_eos=True)))
    for j in range(48):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 200))]
        reqs.append((f"o{j}", prompt, SamplingParams(
            max_tokens=rng.randrange(4, 2 * max_tokens), temperature=rng.choice([0.0, 1.0]),
            ignore_eos=True, is_deterministic=rng.random() < 0.3)))
    rng.shuffle(reqs)
    arrivals = sorted(rng.randrange(0, 8) for _ in reqs)
    outputs: dict[str, Any] = {}
    step = 0
    while reqs or engine.has_unfinished_requests():
        while reqs and arrivals[0] <= step:
            rid, prompt, params = reqs.pop()
            arrivals.pop(0)
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
        for o in engine.step():
            if o.finished and o.request_id.startswith("t"):
                outputs[o.request_id] = _signature(o)
        step += 1
    profile = engine.determinism_profile()
    engine.close()
    digest = hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()[:16]
    return {"outputs": outputs, "digest": digest, "profile": profile,
            "environment": environment(device)}


def compare_records(ra: dict[str, Any], rb: dict[str, Any]) -> dict[str, Any]:
    """One record (a model in a mode) against another, request by request: tokens equal,
    logprobs equal bit for bit, where they first differ; the profile fields and the
    environment fields that differ."""
    requests: dict[str, Any] = {}
    for rid in sorted(set(ra["outputs"]) | set(rb["outputs"])):
        a, b = ra["outputs"].get(rid), rb["outputs"].get(rid)
        if a is None or b is None:
            requests[rid] = {"tokens_equal": False, "logprobs_equal": False,
                             "note": "only in one file"}
            continue
        requests[rid] = {"tokens_equal": a["token_ids"] == b["token_ids"],
                         "logprobs_equal": a["logprobs"] == b["logprobs"],
                         "first_token_diff": _first_diff(a["token_ids"], b["token_ids"]),
                         "first_logprob_diff": _first_diff(a["logprobs"], b["logprobs"])}
    pa, pb = ra.get("profile", {}), rb.get("profile", {})
    ea, eb = ra.get("environment", {}), rb.get("environment", {})
    return {
        "requests": requests,
        "bitwise_equal": bool(requests) and all(r["tokens_equal"] and r["logprobs_equal"]
                                                for r in requests.values()),
        "fingerprints": [pa.get("fingerprint"), pb.get("fingerprint")],
        "profile_diff": {k: [pa.get(k), pb.get(k)] for k in sorted(set(pa) | set(pb))
                         if k != "fingerprint" and pa.get(k) != pb.get(k)},
        "environment_diff": {k: [ea.get(k), eb.get(k)] for k in sorted(set(ea) | set(eb))
                             if k != "host" and ea.get(k) != eb.get(k)},
    }


def _first_diff(a: list[Any], b: list[Any]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts); None if
    they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_files(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    records = {}
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            records[key] = {"bitwise_equal": False, "note": "only in one file"}
        else:
            records[key] = compare_records(a[key], b[key])
    return {"bitwise_equal": bool(records) and all(r["bitwise_equal"] for r in records.values()),
            "records": records}


def compare(a_path: str, b_path: str, report: str | None = None) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    verdict = compare_files(a, b)
    for key, r in verdict["records"].items():
        if "requests" not in r:
            print(f"{key}: {r['note']}")
            continue
        reqs = r["requests"]
        tok = sum(x["tokens_equal"] for x in reqs.values())
        lps = sum(x["logprobs_equal"] for x in reqs.values())
        print(f"{key}: {'BIT FOR BIT' if r['bitwise_equal'] else 'DIFFER'}: tokens equal in "
              f"{tok}/{len(reqs)} requests, logprobs in {lps}/{len(reqs)}; fingerprints "
              f"{r['fingerprints'][0]} / {r['fingerprints'][1]}")
        for rid, x in reqs.items():
            if not (x["tokens_equal"] and x["logprobs_equal"]):
                print(f"  {rid}: first token diff at {x.get('first_token_diff')}, first "
                      f"logprob diff at {x.get('first_logprob_diff')}")
        for k, (va, vb) in r["profile_diff"].items():
            print(f"  profile[{k}]: {va!r} -> {vb!r}")
        for k, (va, vb) in r["environment_diff"].items():
            print(f"  environment[{k}]: {va!r} -> {vb!r}")
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(json.dumps(verdict, indent=1))
    return 0 if verdict["bitwise_equal"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--models", help="several models into one file (keys MODEL|MODE)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="llm42", help="comma-separated engine modes")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="compare two saved files instead of running")
    p.add_argument("--report", help="with --compare: write the verdict JSON here")
    # the options a cross-GPU comparison pins (the lane's product chunk)
    add_flags(p, {k: engine_options()[k] for k in ("lane_gemm_rows",)})
    a = p.parse_args(argv)
    pinned = engine_kwargs(a, skip=("model", "mode", "device", "dtype", "seed"))
    if a.compare:
        return compare(a.compare[0], a.compare[1], report=a.report)
    modes = a.modes.split(",")
    if a.models:
        result = {f"{model}|{m}": run_mode(model, m, a.device, a.dtype, a.max_tokens, a.seed, **pinned)
                  for model in a.models.split(",") for m in modes}
    else:
        result = {m: run_mode(a.model, m, a.device, a.dtype, a.max_tokens, a.seed, **pinned)
                  for m in modes}
    for m, r in result.items():
        print(f"{m}: digest {r['digest']} fingerprint {r['profile'].get('fingerprint')}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
