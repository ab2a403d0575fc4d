"""The engine on CUDA in bf16 through the Triton kernels (skipped without a GPU)."""

from __future__ import annotations

import pytest
from engine_utils import Req, random_prompts, run_engine, signature, tiny_model

from detserve.params import SamplingParams

pytestmark = pytest.mark.gpu

CUDA = {"device": "cuda", "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
                      num_layers=4)


def _reqs(det: bool) -> list[Req]:
    prompts = random_prompts(12, [3, 17, 70, 9, 130], seed=4)
    return [Req(p, SamplingParams(max_tokens=40, is_deterministic=det or i == 0,
                                  temperature=0.8 * (i % 2), top_p=0.9, seed=i, logprobs=1,
                                  ignore_eos=True), arrival=i % 5)
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("lane_sms", [None, 32])
def test_dvr_equals_lane_only_on_gpu(model: str, lane_sms: int | None) -> None:
    reqs = _reqs(det=True)
    oracle, _, _ = run_engine(model, reqs, mode="lane_only", **CUDA)
    dvr, stats, eng = run_engine(model, reqs, perturbation=0.2, lane_sms=lane_sms, **CUDA)
    assert stats["rollbacks"] > 0
    for a, b in zip(oracle, dvr, strict=True):
        assert signature(a) == signature(b)
    alone, _, _ = run_engine(model, reqs[:1], **CUDA)
    assert signature(alone[0]) == signature(oracle[0])
    eng.verifier.close()


def test_batch_invariant_mode_on_gpu(model: str) -> None:
    reqs = _reqs(det=True)
    alone, _, _ = run_engine(model, reqs[:1], mode="batch_invariant", **CUDA)
    full, _, _ = run_engine(model, reqs, mode="batch_invariant", **CUDA)
    assert signature(alone[0]) == signature(full[0])


def test_nondeterministic_mode_runs_on_gpu(model: str) -> None:
    outs, stats, _ = run_engine(model, _reqs(det=False), mode="nondeterministic", **CUDA)
    assert all(len(o.token_ids) == 40 for o in outs)
    assert stats["verify_passes"] == 0
