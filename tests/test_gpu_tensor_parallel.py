"""Tensor parallelism on two or four CUDA devices over NCCL, in bf16 with CUDA graphs
(issue 36; each TP size skipped without that many GPUs): DVR at TP=2 and 4 against the
TP=1 oracle with the TP-invariant lane, the ordinary lane's control, determinism at each
TP size under a changing batch, and a lost worker."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from engine_utils import Req, random_prompts, run_engine, signature, tiny_model

from detserve.engine import LLMEngine
from detserve.parallel.executor import TensorParallelError
from detserve.params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]
# every TP size this machine has the GPUs for (the tiny model's 2 K/V heads are
# replicated at TP=4: a pair of ranks shares each)
TP_SIZES = [pytest.param(n, marks=pytest.mark.skipif(torch.cuda.device_count() < n,
                                                     reason=f"needs {n} CUDA devices"))
            for n in (2, 4)]

CUDA = {"device": "cuda:0", "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def model() -> str:
    # 8 query heads over 2 K/V heads: one K/V head a rank at TP=2, replicated at TP=4
    return tiny_model(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
                      num_layers=4)


@pytest.fixture(scope="module")
def kv_by_leaf() -> str:
    # 8 query heads over 4 K/V heads: the tree keeps each leaf's query, K and V rows
    # together (one qkv call a leaf), as for Llama 3's 8 K/V heads
    return tiny_model(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4,
                      num_layers=4)


def _reqs(n: int = 10, seed: int = 4) -> list[Req]:
    prompts = random_prompts(n, [3, 17, 70, 9, 130], seed=seed)
    return [Req(p, SamplingParams(max_tokens=32, is_deterministic=True,
                                  temperature=0.8 * (i % 2), top_p=0.9, seed=i, logprobs=1,
                                  ignore_eos=True), arrival=i % 4)
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("leaf_major", [False, True])
@pytest.mark.parametrize("tp", TP_SIZES)
def test_invariant_lane_dvr_equals_tp1_lane_only(model: str, kv_by_leaf: str, tp: int,
                                                 leaf_major: bool) -> None:
    """With the TP-invariant lane, llm42 at TP=2 and 4 with the fast path perturbed (the
    lane catches and replaces every bad token) gives the TP=1 lane_only oracle's bits, and
    the same fingerprint as llm42 at TP=1; K/V heads alone in the tree's blocks, or by
    leaf."""
    model = kv_by_leaf if leaf_major else model
    reqs = _reqs()
    oracle, _, eng1 = run_engine(model, reqs, mode="lane_only", tp_invariant_lane=True, **CUDA)
    eng1.close()
    dvr, stats, eng2 = run_engine(model, reqs, perturbation=0.2, tp_invariant_lane=True,
                                  tensor_parallel_size=tp, **CUDA)
    prof2 = eng2.determinism_profile()
    eng2.close()
    _, _, eng3 = run_engine(model, reqs[:1], tp_invariant_lane=True, **CUDA)
    prof1 = eng3.determinism_profile()
    eng3.close()
    assert stats["rollbacks"] > 0
    assert [signature(o) for o in dvr] == [signature(o) for o in oracle]
    assert prof2["fingerprint"] == prof1["fingerprint"] and prof2["tp_size"] == tp


@pytest.mark.parametrize("tp", TP_SIZES)
def test_invariant_lane_at_the_70b_geometry(tp: int) -> None:
    """The 70B shape's first 2 layers (GQA group 8, hidden 8,192, its vocabulary): with the
    TP-invariant lane, TP=2 and 4 run their lane products at the chunk TP=1 does (planned
    from the tree's shapes, the same at every TP size; planned from a rank's own shapes
    the chunks were 256 and 176 rows at TP=4) and give TP=1's outputs, with no rollback
    (the decode tile probe). On 4 x H200 before the column blocks, this failed at TP=4 at
    the outputs (as an audit of 96 requests: 83 differed). Control: the ordinary lane's
    outputs at that TP size are not all TP=1's."""
    spec = "random:llama3-70b@2"
    prompts = random_prompts(8, [40, 300, 9, 130], vocab=30000, seed=5)
    reqs = [Req(p, SamplingParams(max_tokens=96, is_deterministic=True, temperature=0.7,
                                  seed=i, logprobs=1, ignore_eos=True), arrival=i % 3)
            for i, p in enumerate(prompts)]
    kw = {**CUDA, "max_model_len": 1024, "num_blocks": 2048, "window": 64, "group": 8}
    outs, chunks = {}, {}
    for size, invariant in ((1, True), (tp, True), (1, False), (tp, False)):
        got, stats, eng = run_engine(spec, reqs, tensor_parallel_size=size,
                                     tp_invariant_lane=invariant, **kw)
        chunks[size, invariant] = eng.lane_gemm_rows
        eng.close()
        assert stats["rollbacks"] == 0, (size, invariant)
        outs[size, invariant] = [signature(o) for o in got]
    assert chunks[1, True] == chunks[tp, True]
    assert outs[1, True] == outs[tp, True]
    assert outs[1, False] != outs[tp, False]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_ordinary_lane_is_deterministic_but_not_tp1s(model: str, tp: int) -> None:
    """Without the invariant lane, TP=2's and 4's deterministic requests keep their bits
    when the batch around them changes (alone, or among the others with a perturbed fast
    path), but differ from TP=1's lane (the control: the check above would catch a
    TP-dependent sum)."""
    reqs = _reqs()
    mixed, stats, eng = run_engine(model, reqs, perturbation=0.2, tensor_parallel_size=tp,
                                   **CUDA)
    eng.close()
    alone, _, eng = run_engine(model, [reqs[3]], tensor_parallel_size=tp, **CUDA)
    eng.close()
    one, _, eng = run_engine(model, reqs, mode="lane_only", **CUDA)
    eng.close()
    assert stats["rollbacks"] > 0
    assert signature(alone[0]) == signature(mixed[3])
    assert [signature(o) for o in mixed] != [signature(o) for o in one]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_nondeterministic_follows_tp1(model: str, tp: int) -> None:
    """The ordinary mode at TP=2 and 4 computes TP=1's function: greedy logprobs of the
    first token agree within bf16 noise. The TP engine is given plain "cuda" (no index, as
    ``--device cuda`` gives it): its ranks start from cuda:0."""
    reqs = [Req(r.prompt, SamplingParams(max_tokens=1, logprobs=1), r.arrival)
            for r in _reqs()]
    one, _, eng = run_engine(model, reqs, mode="nondeterministic", **CUDA)
    eng.close()
    two, _, eng = run_engine(model, reqs, mode="nondeterministic", tensor_parallel_size=tp,
                             **{**CUDA, "device": "cuda"})
    eng.close()
    for a, b in zip(one, two, strict=True):
        assert a.logprobs and b.logprobs
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.1


def test_lost_worker_fails_the_engine_within_the_deadline(model: str) -> None:
    """A worker stopped mid-generation (it never answers; its NCCL collectives hang): the
    next read-back raises TensorParallelError within tp_timeout_s, never hangs, and no token
    computed after the stop is returned."""
    deadline = 5.0
    engine = LLMEngine.from_args(model, "llm42", tensor_parallel_size=2, tp_timeout_s=deadline,
                                 max_model_len=512, **CUDA)
    workers = engine._workers
    assert workers is not None
    procs = list(workers.procs)
    try:
        engine.add_request("a", None, SamplingParams(max_tokens=400, ignore_eos=True),
                           prompt_token_ids=random_prompts(1, [20], seed=1)[0])
        for _ in range(3):
            engine.step()
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="lost"):
            for _ in range(400):
                engine.step()
        assert time.monotonic() - t0 < deadline + 10.0
        with pytest.raises(TensorParallelError, match="already failed"):
            engine.step()
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices")
def test_ranks_on_later_devices(model: str) -> None:
    """TP=2 on cuda:2 and cuda:3 (a decoder or a TP verifier that does not start at the
    first device): the groups and the peer-load sums, made in a thread of their own, are
    made on rank 0's device, not the process's first one (there the peer sums failed their
    self-check and a pass hit an illegal address), and the invariant lane gives cuda:0's
    TP=2 bits."""
    reqs = _reqs()
    # (first: a process makes peer-load sums for its first TP engine only)
    with torch.cuda.device(2):  # (this thread's kernels launch on the engine's device)
        got, stats, eng = run_engine(model, reqs, perturbation=0.2, tp_invariant_lane=True,
                                     tensor_parallel_size=2, device="cuda:2",
                                     dtype="bfloat16")
    try:
        workers = eng._workers
        assert workers is not None and workers.peer_sums  # they pass their self-check
    finally:
        eng.close()
    want, _, eng = run_engine(model, reqs, tp_invariant_lane=True, tensor_parallel_size=2,
                              **CUDA)
    eng.close()
    assert stats["rollbacks"] > 0
    assert [signature(o) for o in got] == [signature(o) for o in want]
