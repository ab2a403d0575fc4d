"""Offline API behaviour: validation, stop conditions, logprobs, abort, parity with HF."""

from __future__ import annotations

import pytest
import torch
from engine_utils import Req, as_tokens, drive, random_prompts, run_engine, tiny_model

from detserve import LLM, SamplingParams
from detserve.engine import LLMEngine


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model()


@pytest.fixture(scope="module")
def llm(model: str) -> LLM:
    return LLM(model, verify_window=8, verify_group=4, max_model_len=256)


PROMPT = random_prompts(1, [12], seed=5)[0]


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 99}, "logprobs"),
    ({"max_tokens": "7"}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"output_kind": "delta"}, "output_kind"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
])
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_leave_engine_usable(llm: LLM) -> None:
    p = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="non-empty"):
        llm.generate([""], p)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(as_tokens([[]]), p)
    with pytest.raises(ValueError, match="context"):
        llm.generate(as_tokens([[5] * 300]), p)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(as_tokens([[5, 10_000]]), p)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(as_tokens([PROMPT]), SamplingParams(logit_bias={10_000: 1}))
    # a batch with one bad member queues nothing that lingers
    with pytest.raises(ValueError):
        llm.generate(as_tokens([PROMPT, [10_000]]), p)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(as_tokens([PROMPT]), p)
    assert len(out[0].token_ids) == 4
    llm.engine.check_integrity()


def test_unknown_mode_and_bad_engine_config(model: str) -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        LLM(model, mode="turbo")
    with pytest.raises(ValueError):
        LLM(model, fastpath_perturbation=2.0)
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's 1024 positions"):
        LLM(model, max_model_len=4096)
    # options deleted as measured slower (docs/benchmarks/deleted-paths.md) are refused
    for gone in ("lane_priority", "sm_carveout", "blas_library", "lane_overlap",
                 "lane_size_step", "lane_attention_split", "lane_partial_fill"):
        with pytest.raises(TypeError, match=gone):
            LLM(model, **{gone: 1})
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="lane_prefill_ahead"):
            LLM(model, lane_prefill_ahead=bad)
    with pytest.raises((ValueError, FileNotFoundError)):
        LLM("/nonexistent/model")


def test_device_kind_is_a_compatibility_class_only_where_the_kernels_are_ours() -> None:
    """The CUDA profile's device entry. batch_invariant (this project's Triton kernels
    throughout) names a class: architecture, SM count and Triton, so an H100 SXM and an H200
    (sm_90, 132 SMs each; measured to give the same bits) share it, while a card of another
    SM count or architecture, or another Triton, does not. The lane's products are
    cuBLAS's, picked per card (measured to differ between those two): llm42 and lane_only
    name the card."""
    from detserve.numerics import device_kind

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    cls = device_kind("batch_invariant", h100, (9, 0), 132, "3.6.0")
    assert cls == device_kind("batch_invariant", h200, (9, 0), 132, "3.6.0")
    assert cls == "sm_90/132sm/triton-3.6.0"
    for other in (("batch_invariant", h100, (9, 0), 114, "3.6.0"),   # H100 PCIe
                  ("batch_invariant", h100, (10, 0), 132, "3.6.0"),
                  ("batch_invariant", h200, (9, 0), 132, "3.7.0")):
        assert device_kind(*other) != cls
    for mode in ("llm42", "lane_only"):
        assert device_kind(mode, h100, (9, 0), 132, "3.6.0") == h100
        assert device_kind(mode, h100, (9, 0), 132, "3.6.0") != device_kind(
            mode, h200, (9, 0), 132, "3.6.0")
        # where the start-up probe found the lane's products to give the Triton kernel's
        # bits, the lane names the class too (measured: the lane chunk at 512 on both)
        assert device_kind(mode, h100, (9, 0), 132, "3.6.0", portable_products=True) == cls
        assert device_kind(mode, h200, (9, 0), 132, "3.6.0", portable_products=True) == cls
    assert device_kind("nondeterministic", h100, (9, 0), 132, "3.6.0", True) == h100


def test_portable_products_replace_the_chunk_in_the_fingerprint() -> None:
    """With portable lane products the chunk changes no bit: the profile says so instead
    of naming the chunk (an H100 at its probed 256 and an H200 pinned to 512 then share the
    entry); without them the chunk stays."""
    from detserve.numerics import LaneNumerics

    plain = LaneNumerics(lane_gemm_rows=256).profile("llm42")
    assert plain["lane_gemm_rows"] == 256 and "lane_products" not in plain
    a = LaneNumerics(lane_gemm_rows=256, portable_products=True).profile("llm42")
    b = LaneNumerics(lane_gemm_rows=512, portable_products=True).profile("llm42")
    assert a == b and a["lane_products"] == "portable" and "lane_gemm_rows" not in a


def test_kernel_tags_and_fingerprint_entries_come_from_the_lane_numerics() -> None:
    """The kernel set's tags are derived from ``LaneNumerics`` (a tag for each setting of
    other bits, nested sampler config included, in field order), and so are the
    fingerprint's geometry entries, with the keys they always had."""
    from dataclasses import replace

    from detserve.config import EngineConfig, SamplerConfig
    from detserve.numerics import LaneNumerics

    n = LaneNumerics()
    assert n.kernel_tags() == "+lpk"  # the logprob kernel: on by default, bits of its own
    assert replace(n, lane_dot_sums=False).kernel_tags() == "+plainsums+lpk"
    assert replace(n, sampling=SamplerConfig(logprob_kernel=False)).kernel_tags() == ""
    # the same bits either way: no tag
    assert replace(n, fused_silu_mul=False, fused_add_rmsnorm=False, lane_full_tiles=False,
                   sampling=SamplerConfig(gumbel_kernel=False)).kernel_tags() == "+lpk"
    assert n.profile("llm42") == {"verify_window": 64, "verify_group": 8, "block_size": 16}
    assert replace(n, lane_gemm_rows=16).profile("batch_invariant") == {
        "verify_window": 64, "verify_group": 8, "block_size": 16,
        "batch_invariant_rows": 32, "lane_gemm_rows": 16}
    cfg = EngineConfig.create("m", verify_window=8, verify_group=4, lane_dot_sums=False,
                              logprob_kernel=False, block_size=32, dtype="float32",
                              max_model_len=2048)
    got = LaneNumerics.from_config(cfg, lane_gemm_rows=16)
    assert (got.lane_rows, got.lane_gemm_rows, got.block_size) == (32, 16, 32)
    assert got.lane_sizes == (16, 32) and LaneNumerics.from_config(cfg, 0).lane_sizes == (32,)
    assert not got.lane_dot_sums and not got.sampling.logprob_kernel
    assert replace(got, lane_gemm_rows=24).lane_sizes == (24, 48)  # the last one may pass it
    with pytest.raises(ValueError, match="aligned_decode_lane"):
        replace(n, aligned_decode_lane="16:1")
    with pytest.raises(ValueError, match="verify_window"):
        replace(n, verify_window=0)


def test_max_tokens_and_finish_reason(llm: LLM) -> None:
    outs = llm.generate(as_tokens([PROMPT] * 2), [
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=11, ignore_eos=True, is_deterministic=True)])
    assert [len(o.token_ids) for o in outs] == [5, 11]
    assert all(o.finish_reason == "length" and o.finished for o in outs)


def test_stop_token_ids_and_stop_strings(llm: LLM) -> None:
    free = llm.generate(as_tokens([PROMPT]),
                        SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop_tok = free.token_ids[6]
    first = free.token_ids.index(stop_tok)
    for det in (False, True):
        out = llm.generate(as_tokens([PROMPT]), SamplingParams(
            max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok], is_deterministic=det))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == free.token_ids[:first + 1]
    text = free.text
    needle = text[len(text) // 2: len(text) // 2 + 3]
    if needle.strip():
        out = llm.generate(as_tokens([PROMPT]), SamplingParams(
            max_tokens=30, ignore_eos=True, stop=[needle], is_deterministic=True))[0]
        assert out.finish_reason == "stop"
        assert needle not in out.text and text.startswith(out.text)


def test_logprobs_topk(llm: LLM) -> None:
    for det in (False, True):
        out = llm.generate(as_tokens([PROMPT]), SamplingParams(
            max_tokens=6, logprobs=3, is_deterministic=det, ignore_eos=True))[0]
        assert out.logprobs is not None and len(out.logprobs) == 6
        for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
            assert lp.token_id == tok and lp.logprob <= 0
            assert len(lp.top) == 3
            assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy: chosen is top-1


def test_min_tokens_masks_eos(model: str) -> None:
    eng = LLMEngine.from_args(model, "llm42", verify_window=8, verify_group=4, max_model_len=256)
    eos = next(iter(eng.scheduler.eos_token_ids))
    outs, _, _ = run_engine(model, [Req(PROMPT, SamplingParams(
        max_tokens=12, min_tokens=12, stop_token_ids=[], is_deterministic=True))])
    assert len(outs[0].token_ids) == 12 and eos not in outs[0].token_ids


def test_abort(model: str) -> None:
    eng = LLMEngine.from_args(model, "llm42", verify_window=8, verify_group=4, max_model_len=256)
    eng.add_request("a", None, SamplingParams(max_tokens=50, is_deterministic=True,
                                               ignore_eos=True), prompt_token_ids=PROMPT)
    eng.add_request("b", None, SamplingParams(max_tokens=50, ignore_eos=True),
                    prompt_token_ids=PROMPT)
    for _ in range(3):
        eng.step()
    assert eng.abort_request("a") and eng.abort_request("b")
    assert not eng.abort_request("missing")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    eng.check_integrity()
    assert eng.blocks.num_free == eng.blocks.num_blocks - 1
    # every aborted request gets one final output, whether or not its window was in the lane
    finals = [o for o in outs if o.finished]
    assert sorted(o.request_id for o in finals) == ["a", "b"]
    assert {o.finish_reason for o in finals} == {"abort"}
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request("c", None, SamplingParams(), prompt_token_ids=PROMPT)
        eng.add_request("c", None, SamplingParams(), prompt_token_ids=PROMPT)


@pytest.mark.parametrize("threaded", [False, True], ids=["in-process", "lane-thread"])
def test_abort_a_prompt_admitted_ahead_into_spare_lane_rows(model: str, threaded: bool) -> None:
    """A deterministic request queued behind others whose prompt went to a lane pass's
    spare rows (admitted ahead) can be aborted while that chunk is in the lane: it gets one
    final output, its blocks come back once the pass returns, and the others finish."""
    eng = LLMEngine.from_args(model, "llm42", verify_window=8, verify_group=4,
                              max_model_len=256, max_num_seqs=2, lane_threaded=threaded)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    det = SamplingParams(max_tokens=12, ignore_eos=True, is_deterministic=True)
    eng.add_request("d0", None, det, prompt_token_ids=PROMPT)
    for i in range(3):
        eng.add_request(f"n{i}", None, plain, prompt_token_ids=PROMPT)
    eng.add_request("late", None, det, prompt_token_ids=random_prompts(1, [40], seed=9)[0])
    outs = eng.step()
    assert eng.stats()["lane_ahead_admissions"] == 1, "the late prompt went into spare rows"
    assert eng.abort_request("late")
    while eng.has_unfinished_requests():
        outs += eng.step()
    eng.check_integrity()
    assert eng.blocks.num_free == eng.blocks.num_blocks - 1
    finals = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert finals == {"d0": "length", "n0": "length", "n1": "length", "n2": "length",
                      "late": "abort"}
    eng.close()


def test_staggered_arrivals_api(llm: LLM) -> None:
    p = SamplingParams(max_tokens=8, is_deterministic=True, ignore_eos=True, logprobs=0)
    a = llm.generate(as_tokens([PROMPT]), p)[0]
    prompts = random_prompts(4, [5, 30, 9], seed=3) + [PROMPT]
    outs = drive(llm.engine, [Req(prompt, p, arrival)
                              for prompt, arrival in zip(prompts, [0, 2, 4, 1, 3], strict=True)])
    assert outs[-1].token_ids == a.token_ids
    assert [x.logprob for x in outs[-1].logprobs or []] == [x.logprob for x in a.logprobs or []]


@pytest.mark.parametrize("mode", ["nondeterministic", "lane_only", "batch_invariant"])
def test_engine_matches_transformers(model: str, mode: str) -> None:
    """Greedy tokens and logprobs of the paged engine vs HF LlamaForCausalLM (fp32)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    prompts = random_prompts(3, [7, 33, 18], seed=21)
    n = 12
    outs, _, _ = run_engine(model, [Req(p, SamplingParams(max_tokens=n, logprobs=0,
                                                          ignore_eos=True)) for p in prompts],
                            mode=mode)
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=n, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
                              min_new_tokens=n)
        hf_tokens = gen.sequences[0, len(p):].tolist()
        assert out.token_ids == hf_tokens
        hf_lp = [torch.log_softmax(s[0].float(), -1)[t].item()
                 for s, t in zip(gen.scores, hf_tokens, strict=True)]
        ours = [lp.logprob for lp in out.logprobs or []]
        assert ours == pytest.approx(hf_lp, abs=1e-4)


@pytest.mark.slow
def test_smollm2_answers_paris() -> None:
    llm = LLM("smollm2", verify_window=16, verify_group=2, max_model_len=512)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    det, fast = llm.chat([msgs, msgs], [SamplingParams(max_tokens=24, is_deterministic=True),
                                        SamplingParams(max_tokens=24)])
    assert "Paris" in det.text, det.text
    assert "Paris" in fast.text, fast.text
    assert det.finish_reason == "stop"


@pytest.mark.parametrize("mode,det", [("nondeterministic", False), ("llm42", True)])
def test_output_kinds(model: str, mode: str, det: bool) -> None:
    """cumulative: an output for every step that commits tokens, growing to the final one;
    final_only: just the final output, with the same tokens, text and logprobs."""
    def run(kind: str) -> list:
        eng = LLMEngine.from_args(model, mode, verify_window=8, verify_group=4,
                                  max_model_len=256)
        for rid, prompt in (("x", PROMPT), ("y", PROMPT[:5])):
            eng.add_request(rid, None, SamplingParams(
                max_tokens=20, ignore_eos=True, is_deterministic=det, logprobs=1,
                output_kind=kind), prompt_token_ids=prompt)
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        return outs

    cum, final = run("cumulative"), run("final_only")
    assert all(o.finished for o in final) and sorted(o.request_id for o in final) == ["x", "y"]
    for rid in ("x", "y"):
        steps = [o for o in cum if o.request_id == rid]
        assert len(steps) > 2 and steps[-1].finished and not steps[0].finished
        assert sum(o.num_new_tokens for o in steps) == len(steps[-1].token_ids) == 20
        assert all(a.token_ids == b.token_ids[:len(a.token_ids)]
                   for a, b in zip(steps, steps[1:], strict=False))
        (last,) = [o for o in final if o.request_id == rid]
        assert last.token_ids == steps[-1].token_ids and last.text == steps[-1].text
        assert last.logprobs == steps[-1].logprobs
        assert last.stats.first_token_time is not None


def test_generate_command_takes_penalties_and_logit_bias(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """``detserve generate`` passes --logit-bias / --presence-penalty / --frequency-penalty
    to the request, and refuses bad values with a message and exit code 2."""
    import json

    from services.console import main

    args = ["generate", "--model", "random:tiny", "--prompt", "a b c", "--max-tokens", "5",
            "--json"]
    assert main([*args, "--logit-bias", "7=100", "--presence-penalty", "-1"]) == 0
    rec = json.loads(capsys.readouterr().out.splitlines()[0])
    assert rec["token_ids"] == [7] * 5
    assert main([*args, "--frequency-penalty", "2.5"]) == 2
    assert "frequency_penalty must be in [-2, 2]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--logit-bias", "seven=1"])


def test_lane_wait_default_follows_the_device(model: str) -> None:
    """``lane_max_wait_steps`` left unset: 16 steps on CPU, where a lane pass runs its whole
    shape (0 on CUDA, where a pass runs only the row multiples it needs: a deterministic
    prompt's first token then never waits for a pass to fill); a value given is kept."""
    from detserve.config import LANE_WAIT_STEPS

    assert LANE_WAIT_STEPS == {"cuda": 0, "cpu": 16}
    eng = LLMEngine.from_args(model, "llm42", verify_window=8, verify_group=4)
    assert eng.scheduler.cfg.lane_max_wait_steps == 16
    eng.close()
    eng = LLMEngine.from_args(model, "llm42", verify_window=8, verify_group=4,
                              lane_max_wait_steps=0)
    assert eng.scheduler.cfg.lane_max_wait_steps == 0
    eng.close()
