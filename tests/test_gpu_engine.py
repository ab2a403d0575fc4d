"""The engine on CUDA in bf16 through the Triton kernels (skipped without a GPU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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
    """Also with the lane in a green context of 32 SMs."""
    reqs = _reqs(det=True)
    oracle, _, _ = run_engine(model, reqs, mode="lane_only", **CUDA)
    dvr, stats, eng = run_engine(model, reqs, perturbation=0.2, lane_sms=lane_sms, **CUDA)
    assert stats["rollbacks"] > 0
    for a, b in zip(oracle, dvr, strict=True):
        assert signature(a) == signature(b)
    alone, _, _ = run_engine(model, reqs[:1], **CUDA)
    assert signature(alone[0]) == signature(oracle[0])
    eng.verifier.close()


def _sampled_reqs(n: int, seed: int, temperatures: tuple[float, ...],
                  det: Callable[[int], bool], arrivals: int, seed0: int) -> list[Req]:
    """Seeded requests of mixed temperatures, with and without a top-k."""
    prompts = random_prompts(n, [3, 17, 70, 9, 130], seed=seed)
    return [Req(p, SamplingParams(max_tokens=40, is_deterministic=det(i),
                                  temperature=temperatures[i % len(temperatures)],
                                  top_k=(0, 20)[i % 2], seed=seed0 + i, ignore_eos=True),
                arrival=i % arrivals)
            for i, p in enumerate(prompts)]


def _count_gumbel_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time ``sampler.gumbel_rows`` runs."""
    from detserve import sampler

    calls: list[int] = []
    batched = sampler.gumbel_rows
    monkeypatch.setattr(sampler, "gumbel_rows", lambda *a, **k: calls.append(1) or batched(*a, **k))
    return calls


def test_sampled_rows_picked_many_at_a_time_keep_dvr_equal_to_lane_only(
        model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded temperature / top-k requests without top-p or logprobs: the fast path and the
    lane sample their rows many at a time (``sampler.gumbel_rows``). DVR under perturbation
    equals lane_only; a request alone equals itself in the batch; and the outputs equal
    those of row-by-row sampling (``gumbel_chunk_rows`` 0). Control: the many-row path ran."""

    reqs = _sampled_reqs(12, 6, (0.7, 1.0, 1.3), det=lambda i: i % 3 != 2, arrivals=5,
                         seed0=100)
    calls = _count_gumbel_passes(monkeypatch)
    oracle, _, o = run_engine(model, reqs, mode="lane_only", **CUDA)
    dvr, stats, eng = run_engine(model, reqs, perturbation=0.2, **CUDA)
    assert calls and stats["rollbacks"] > 0
    det = [i for i, r in enumerate(reqs) if r.params.is_deterministic]
    for i in det:
        assert signature(oracle[i]) == signature(dvr[i]), i
    alone, _, a = run_engine(model, reqs[:1], **CUDA)
    assert signature(alone[0]) == signature(oracle[0])
    n = len(calls)
    rows, _, r = run_engine(model, reqs, mode="lane_only", gumbel_chunk_rows=0, **CUDA)
    assert len(calls) == n, "row by row"
    for i in det:
        assert signature(rows[i]) == signature(oracle[i]), i
    for e in (o, eng, a, r):
        e.close()


def test_decode_steps_without_deterministic_rows_replay_the_plain_graphs(model: str) -> None:
    """llm42 (aligned decode graphs): a decode step whose rows are all non-deterministic
    replays the plain fast path's graphs, one with a deterministic decode row the aligned
    ones. The deterministic output still equals lane_only's under perturbation (which rolls
    windows back), and with the option off. Requests without determinism alone replay plain
    graphs only and get nondeterministic mode's outputs (the same graphs). Control: off,
    no replay is plain."""
    # request 0 deterministic, the others not and long enough to decode on after it ends
    reqs = [Req(r.prompt, dataclasses.replace(r.params, max_tokens=16 if i == 0 else 160),
                r.arrival) for i, r in enumerate(_reqs(det=False))]
    oracle, _, o = run_engine(model, reqs, mode="lane_only", **CUDA)
    dvr, stats, eng = run_engine(model, reqs, perturbation=0.5, **CUDA)
    assert stats["rollbacks"] > 0
    assert 0 < stats["plain_graph_replays"] < stats["decode_graph_replays"]
    assert signature(dvr[0]) == signature(oracle[0])
    off, s_off, e_off = run_engine(model, reqs, plain_decode_graphs=False, **CUDA)
    assert s_off["plain_graph_replays"] == 0 < s_off["decode_graph_replays"]
    assert signature(off[0]) == signature(oracle[0])
    others, s_others, e_others = run_engine(model, reqs[1:], **CUDA)
    assert s_others["plain_graph_replays"] == s_others["decode_graph_replays"] > 0
    plain, _, e_plain = run_engine(model, reqs[1:], mode="nondeterministic", **CUDA)
    assert [signature(a) for a in others] == [signature(b) for b in plain]
    for e in (o, eng, e_off, e_others, e_plain):
        e.close()


def test_batch_invariant_mode_on_gpu(model: str) -> None:
    reqs = _reqs(det=True)
    alone, _, _ = run_engine(model, reqs[:1], mode="batch_invariant", **CUDA)
    full, _, _ = run_engine(model, reqs, mode="batch_invariant", **CUDA)
    assert signature(alone[0]) == signature(full[0])


def test_logprob_rows_picked_many_at_a_time_keep_dvr_equal_to_lane_only(
        model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``logprob_kernel`` on: greedy and seeded rows asking for logprobs take the many-row
    paths, their logprobs from one ``kernels.logprobs`` pass. DVR under perturbation equals
    lane_only (tokens and logprobs); a request alone equals itself in the batch; the kernel
    set says "+lpk". Control: the pass ran."""
    from detserve import sampler

    prompts = random_prompts(10, [3, 17, 70, 9, 130], seed=8)
    reqs = [Req(p, SamplingParams(max_tokens=40, is_deterministic=i % 4 != 3,
                                  temperature=(0.0, 0.9)[i % 2], logprobs=(0, 2, 5)[i % 3],
                                  seed=300 + i, ignore_eos=True), arrival=i % 5)
            for i, p in enumerate(prompts)]
    calls = []
    many = sampler._many_logprobs
    monkeypatch.setattr(sampler, "_many_logprobs",
                        lambda *a: (r := many(*a)) is not None and calls.append(1) or r)
    oracle, _, o = run_engine(model, reqs, mode="lane_only", logprob_kernel=True, **CUDA)
    dvr, stats, eng = run_engine(model, reqs, perturbation=0.2, logprob_kernel=True, **CUDA)
    assert calls and stats["rollbacks"] > 0
    from detserve.executor.gpu import KERNEL_VERSION

    assert eng.runner.numerics.kernel_tags() == "+lpk"  # the logprobs' bits: that pass's own
    assert eng.runner.kernel_set.startswith(KERNEL_VERSION + "+lpk")
    for i, r in enumerate(reqs):
        if r.params.is_deterministic:
            assert signature(oracle[i]) == signature(dvr[i]), i
            tops = [[lp.top for lp in out.logprobs or []] for out in (oracle[i], dvr[i])]
            assert tops[0] == tops[1] and len(tops[0]) == 40, i
    alone, _, a = run_engine(model, reqs[:1], logprob_kernel=True, **CUDA)
    assert signature(alone[0]) == signature(oracle[0])
    for e in (o, eng, a):
        e.close()


def test_batch_invariant_mode_samples_many_rows_on_gpu(
        model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_invariant samples as every mode does: greedy rows in one argmax, seeded
    temperature / top-k rows in one Gumbel pass (``sampler.gumbel_rows``). A request alone
    equals itself in the batch, and every output equals row-by-row sampling's. Control:
    the Gumbel pass ran."""
    from detserve.executor import runner

    reqs = _sampled_reqs(10, 7, (0.0, 0.8, 1.2), det=lambda i: True, arrivals=4,
                         seed0=200)
    calls = _count_gumbel_passes(monkeypatch)
    full, _, f = run_engine(model, reqs, mode="batch_invariant", **CUDA)
    assert calls
    alone, _, a = run_engine(model, reqs[1:2], mode="batch_invariant", **CUDA)
    assert signature(alone[0]) == signature(full[1])
    real = runner.launch_rows
    monkeypatch.setattr(runner, "launch_rows",
                        lambda logits, specs, positions, **kw: real(logits, specs, positions,
                                                                    row_by_row=True, **kw))
    rows, _, r = run_engine(model, reqs, mode="batch_invariant", **CUDA)
    assert [signature(o) for o in rows] == [signature(o) for o in full]
    for e in (f, a, r):
        e.close()


def test_nondeterministic_mode_runs_on_gpu(model: str) -> None:
    """Nondeterministic mode has no lane to align with: its decode rows take split-KV
    attention (the faster kernel), llm42's the lane's kernel."""
    outs, stats, eng = run_engine(model, _reqs(det=False), mode="nondeterministic", **CUDA)
    assert all(len(o.token_ids) == 40 for o in outs)
    assert stats["verify_passes"] == 0
    assert not eng.runner.align_fast_path and eng.alignment is None
    eng.close()
    _, _, lane = run_engine(model, _reqs(det=True)[:1], mode="llm42", **CUDA)
    assert lane.runner.align_fast_path
    lane.close()


def test_cuda_graphs_batch_invariant_bitwise_equal_to_eager(model: str) -> None:
    """Batch-invariant kernels give a row the same bits at any batch size, so replaying a
    padded decode graph must reproduce the eager path exactly."""
    reqs = _reqs(det=True)
    eager, _, e1 = run_engine(model, reqs, mode="batch_invariant", cuda_graphs=False, **CUDA)
    graphed, stats, e2 = run_engine(model, reqs, mode="batch_invariant", **CUDA)
    assert e2.runner.decode_graphs is not None and e1.runner.decode_graphs is None
    assert stats["step_graph_replays"] > 0  # steps with prompt chunks replayed graphs too
    for a, b in zip(eager, graphed, strict=True):
        assert signature(a) == signature(b)


def test_cuda_graphs_fast_path_close_to_eager(model: str) -> None:
    """Fast-path graphs may reduce in another order than eager, but not compute anything
    else: greedy tokens agree until the first near-tie and logprobs stay within bf16 noise."""
    reqs = [Req(r.prompt, SamplingParams(max_tokens=24, logprobs=0, ignore_eos=True), r.arrival)
            for r in _reqs(det=False)]
    eager, eager_stats, _ = run_engine(model, reqs, mode="nondeterministic", cuda_graphs=False,
                                       **CUDA)
    graphed, stats, eng = run_engine(model, reqs, mode="nondeterministic", **CUDA)
    assert eng.runner.decode_graphs is not None
    assert eager_stats["step_graph_replays"] == 0 and stats["step_graph_replays"] > 0
    # every graph replay is timed on the GPU, and takes less than its whole host-side step
    assert eager_stats["decode_graph_replays"] == 0
    assert 0 < stats["decode_graph_replays"] <= stats["decode_steps"]
    assert 0 < stats["decode_graph_gpu_s"] < stats["decode_step_seconds"]
    common = []
    for a, b in zip(eager, graphed, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True))
                  if x != y), len(a.token_ids))
        common.append(n)
        for la, lb in zip(a.logprobs[:n], b.logprobs[:n], strict=True):  # type: ignore[index]
            assert abs(la.logprob - lb.logprob) < 0.1
    assert sum(common) >= 0.5 * sum(len(o.token_ids) for o in eager)


def test_lane_graph_dvr_equals_lane_only_with_and_without_graphs(model: str) -> None:
    """Every lane pass runs through one graph: DVR under perturbation equals lane_only."""
    reqs = _reqs(det=True)
    oracle, _, o = run_engine(model, reqs, mode="lane_only", **CUDA)
    dvr, stats, eng = run_engine(model, reqs, perturbation=0.3, **CUDA)
    assert o.runner.lane_graph is not None and eng.runner.lane_graph is not None
    assert stats["rollbacks"] > 0
    for a, b in zip(oracle, dvr, strict=True):
        assert signature(a) == signature(b)
    eng.close()
    o.close()


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("prompt_len", [40, 2100])
def test_aligned_fast_path_alone_verifies_every_window(model: str, graphs: bool,
                                                       prompt_len: int) -> None:
    """A deterministic request decoding alone: the fast path runs batch 1 with the lane's
    attention kernel, and the lane's GEMM chunk is in batch 1's cuBLAS class, so every
    window matches bit for bit (no rollback) and equals lane_only; past the lane's first
    span (2,100 tokens of prompt) too, where the context reduces span by span on both
    sides. Control: perturbing the fast path on the same engine configuration does roll
    windows back."""
    if prompt_len > 1024:  # the module's model has 1,024 positions
        model = tiny_model(hidden_size=256, intermediate_size=512, num_heads=8,
                           num_kv_heads=2, num_layers=4, max_position_embeddings=4096)
    req = [Req(random_prompts(1, [prompt_len], seed=9)[0],
               SamplingParams(max_tokens=120, is_deterministic=True, logprobs=1,
                              ignore_eos=True))]
    kw = {"max_num_seqs": 1, "cuda_graphs": graphs, "max_model_len": 4096 if prompt_len > 1024
          else 512, **CUDA}
    oracle, _, o = run_engine(model, req, mode="lane_only", window=16, group=1, **kw)
    dvr, stats, eng = run_engine(model, req, window=16, group=1, **kw)
    prof = eng.determinism_profile()  # the chunk, or "portable" where it gives Triton's bits
    assert eng.lane_gemm_rows > 0 and (prof.get("lane_gemm_rows") == eng.lane_gemm_rows
                                       or prof.get("lane_products") == "portable")
    assert stats["windows"] >= 7 and stats["rollbacks"] == 0
    assert signature(dvr[0]) == signature(oracle[0])
    _, perturbed, p = run_engine(model, req, window=16, group=1, perturbation=0.2, **kw)
    assert perturbed["rollbacks"] > 0
    for e in (o, eng, p):
        e.close()


def test_lane_masked_tiles_give_the_full_tiles_output(model: str) -> None:
    """EngineConfig.lane_full_tiles (on by default) runs the lane's and the aligned fast
    path's whole KV tiles unmasked. It is not part of the numerics: an engine with every
    tile masked commits the default engine's lane_only output token for token and logprob
    for logprob, its lone request's windows verify without a rollback, and both report
    one kernel set (so a verifier replica with either setting serves either decoder)."""
    reqs = _reqs(det=True)
    oracle, _, o = run_engine(model, reqs, mode="lane_only", **CUDA)
    kw = {"lane_full_tiles": False, **CUDA}
    dvr, _, eng = run_engine(model, reqs, **kw)
    assert o.runner.lane_attn.full_tiles and not eng.runner.lane_attn.full_tiles
    assert eng.runner.kernel_set == o.runner.kernel_set
    for a, b in zip(oracle, dvr, strict=True):
        assert signature(a) == signature(b)
    req = [Req(random_prompts(1, [40], seed=9)[0],
               SamplingParams(max_tokens=120, is_deterministic=True, logprobs=1,
                              ignore_eos=True))]
    _, stats, alone = run_engine(model, req, window=16, group=1, max_num_seqs=1, **kw)
    assert stats["windows"] >= 7 and stats["rollbacks"] == 0
    for e in (o, eng, alone):
        e.close()


def test_aligned_decode_lane_config_keeps_dvr_equal_to_lane_only(model: str) -> None:
    """The fast path's decode rows on another config of the lane kernel (a 16-slot query
    tile, one warp): committed output still equals lane_only, whatever that config's bits
    (the lane verifies every window; a window whose bits differ rolls back), the lane and
    prompt rows keep the lane's own config, and batch_invariant graphs never take it."""
    from detserve.kernels.config import TABLE

    reqs = _reqs(det=True)
    oracle, _, o = run_engine(model, reqs, mode="lane_only", **CUDA)
    dvr, _, eng = run_engine(model, reqs, aligned_decode_lane="16:1:2", **CUDA)
    assert (eng.runner.decode_attn.block_m, eng.runner.decode_attn.num_warps) == (16, 1)
    assert eng.runner.lane_attn == TABLE.lane
    assert eng.runner.decode_graphs is not None
    assert eng.runner.decode_graphs.lane_cfg == eng.runner.decode_attn
    for a, b in zip(oracle, dvr, strict=True):
        assert signature(a) == signature(b)
    _, _, bi = run_engine(model, _reqs(det=True)[:2], mode="batch_invariant",
                          aligned_decode_lane="16:1:2", **CUDA)
    assert bi.runner.decode_graphs is not None and bi.runner.decode_graphs.lane_cfg == TABLE.lane
    for e in (o, eng, bi):
        e.close()


def test_auto_decode_tile_is_probed_at_the_models_gqa_group(model: str) -> None:
    """``aligned_decode_lane`` "auto" resolves at start-up: the 16-slot tile at the module
    model's group of 4, the lane's own tile at a group of 8 (the 70B shape's, where the
    16-slot tile gave decode rows other bits and most windows rolled back), where a lone
    deterministic request then verifies every window and equals lane_only. An explicit
    tile is kept."""
    from detserve.kernels.config import DECODE_LANE_AUTO

    _, _, four = run_engine(model, _reqs(det=True)[:2], **CUDA)
    assert four.numerics.aligned_decode_lane == DECODE_LANE_AUTO
    eight = tiny_model(hidden_size=1024, intermediate_size=512, num_heads=8, num_kv_heads=1,
                       num_layers=2)
    req = [Req(random_prompts(1, [300], seed=9)[0],
               SamplingParams(max_tokens=120, is_deterministic=True, logprobs=1,
                              temperature=0.7, seed=3, ignore_eos=True))]
    oracle, _, o = run_engine(eight, req, mode="lane_only", window=16, group=1, **CUDA)
    dvr, stats, eng = run_engine(eight, req, window=16, group=1, max_num_seqs=1, **CUDA)
    assert eng.numerics.aligned_decode_lane == ""
    assert eng.runner.decode_attn == eng.runner.lane_attn
    assert stats["windows"] >= 7 and stats["rollbacks"] == 0
    assert signature(dvr[0]) == signature(oracle[0])
    _, _, kept = run_engine(eight, req, aligned_decode_lane=DECODE_LANE_AUTO, **CUDA)
    assert kept.numerics.aligned_decode_lane == DECODE_LANE_AUTO
    for e in (four, o, eng, kept):
        e.close()


UNFUSED = {"fused_silu_mul": False, "fused_add_rmsnorm": False}


@pytest.mark.parametrize("flag", ["fused_silu_mul", "fused_add_rmsnorm"])
def test_fused_ops_give_the_unfused_engines_bits(model: str, flag: str) -> None:
    """The fused SiLU-and-multiply and the residual add fused into the RMSNorm (both on by
    default) give the unfused bits: with either, llm42 commits the output of an engine with
    torch's kernels token for token and logprob for logprob with no window rolled back, and
    batch_invariant gives its output too. So the kernel set is the same either way."""
    reqs = _reqs(det=True)
    base, _, b = run_engine(model, reqs, **UNFUSED, **CUDA)
    fused, stats, f = run_engine(model, reqs, **{**UNFUSED, flag: True}, **CUDA)
    assert f.runner.kernel_set == b.runner.kernel_set
    assert getattr(f.runner.fast_ops, flag) and getattr(f.runner.lane_ops, flag)
    assert not getattr(b.runner.fast_ops, flag)
    assert stats["windows"] > 0 and stats["rollbacks"] == 0
    for a, c in zip(base, fused, strict=True):
        assert signature(a) == signature(c)
    bi_base, _, bb = run_engine(model, reqs[:3], mode="batch_invariant", **UNFUSED, **CUDA)
    bi_fused, _, bf = run_engine(model, reqs[:3], mode="batch_invariant",
                                 **{**UNFUSED, flag: True}, **CUDA)
    assert getattr(bf.runner.bi_ops, flag)
    for a, c in zip(bi_base, bi_fused, strict=True):
        assert signature(a) == signature(c)
    for e in (b, f, bb, bf):
        e.close()


def test_unaligned_fast_path_still_deterministic(model: str) -> None:
    """align_fast_path=False (split-KV decode, whole-pass lane GEMMs) keeps DVR == lane_only."""
    reqs = _reqs(det=True)
    oracle, _, o = run_engine(model, reqs, mode="lane_only", align_fast_path=False, **CUDA)
    dvr, _, eng = run_engine(model, reqs, perturbation=0.2, align_fast_path=False, **CUDA)
    assert eng.lane_gemm_rows == 0 and "lane_gemm_rows" not in eng.determinism_profile()
    for a, b in zip(oracle, dvr, strict=True):
        assert signature(a) == signature(b)
    o.close()
    eng.close()


def test_lane_pass_runs_only_the_chunks_its_rows_fill(model: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane pass runs the multiples of its GEMM chunk that its rows fill; a row's bits do
    not depend on how many chunks ran, so the outputs equal those of passes always run at
    full size (graphs of every size are captured and replayed)."""
    from detserve.executor.runner import ModelRunner

    reqs = _reqs(det=True)
    kw = {"mode": "lane_only", "lane_gemm_rows": 16, **CUDA}
    trimmed, stats, eng = run_engine(model, reqs, **kw)
    assert eng.runner.lane_sizes() == [16, 32]
    assert stats["lane_computed_rows"] < 32 * stats["verify_passes"]  # some passes trimmed
    monkeypatch.setattr(ModelRunner, "lane_run_rows", lambda self, used: self.lane_sizes()[-1])
    full, fstats, f = run_engine(model, reqs, **kw)
    assert fstats["lane_computed_rows"] == 32 * fstats["verify_passes"]
    for a, b in zip(trimmed, full, strict=True):
        assert signature(a) == signature(b)
    eng.close()
    f.close()


@pytest.mark.parametrize(("graphs", "probe", "steps"),
                         [(True, True, False), (False, True, False), (True, False, False),
                          (True, True, True), (True, False, True)])
def test_aligned_decode_rows_verify_next_to_prefill_chunks(
        model: str, graphs: bool, probe: bool, steps: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic requests decode while later ones arrive and prefill: steps that mix
    decode rows with prefill chunks pad the decode rows' products to their bucket, or,
    where the start-up probe found the step's size in the lane chunk's algorithm, run them
    as one call over all rows; either way no window rolls back (the fast path computes what
    the lane computes). ``steps``: those steps replay step graphs (the products split at
    the largest decode bucket), else they run eagerly."""
    from detserve.executor import runner as runner_mod

    unsplit: list[int] = []
    real = runner_mod.HeadPaddedOps.linear

    def spy(self, x, weight, bias=None):  # type: ignore[no-untyped-def]
        if x.shape[0] in self.single_call.get(tuple(weight.shape), ()):
            unsplit.append(x.shape[0])
        return real(self, x, weight, bias)

    monkeypatch.setattr(runner_mod.HeadPaddedOps, "linear", spy)
    prompts = random_prompts(6, [30, 200, 60, 150], seed=11)
    reqs = [Req(p, SamplingParams(max_tokens=48, is_deterministic=i % 2 == 0, ignore_eos=True),
                arrival=6 * i) for i, p in enumerate(prompts)]
    outs, stats, eng = run_engine(model, reqs, window=16, group=2, cuda_graphs=graphs,
                                  max_num_batched_tokens=96, probe_single_calls=probe,
                                  cuda_graph_step_rows=96 if steps else 0,
                                  # (steps: a small top decode bucket, so that graphs of
                                  # 96 rows split their products after it)
                                  **({"max_num_seqs": 8} if steps else {}), **CUDA)
    assert eng.alignment is not None and stats["windows"] >= 9
    assert stats["rollbacks"] == 0
    assert bool(eng.alignment.single_call) == probe
    if steps:  # the split ran while the graphs were captured
        assert stats["step_graph_replays"] > 0 and eng.runner.step_graphs is not None
        assert eng.runner.step_graphs.aligned_replays > 0
    else:
        assert bool(unsplit) == probe
    oracle, _, o = run_engine(model, reqs, mode="lane_only", window=16, group=2, **CUDA)
    for i in range(0, 6, 2):
        assert signature(outs[i]) == signature(oracle[i])
    eng.close()
    o.close()


@pytest.mark.parametrize(("chunk", "window", "group"), [(16, 8, 4), (48, 16, 6)])
def test_lane_one_calls_keep_the_lanes_bits(model: str, chunk: int, window: int,
                                            group: int) -> None:
    """Lane products run as one call where the probe allows (at the chunk's multiples) give
    the same outputs as the lane run chunk by chunk (the tiny model's products may or may
    not allow any)."""
    reqs = _reqs(det=True)
    kw = {"mode": "llm42", "lane_gemm_rows": chunk, "window": window, "group": group, **CUDA}
    one, _, eng = run_engine(model, reqs, **kw)
    chunked, _, ref = run_engine(model, reqs, lane_one_calls=False, **kw)
    assert ref.runner.lane_one_call == {}
    multiples = [chunk, 2 * chunk]
    sizes = eng.runner.lane_sizes()
    assert sizes == ref.runner.lane_sizes() == multiples
    print("lane sizes:", sizes, {k: sorted(v) for k, v in eng.runner.lane_one_call.items()})
    assert all(k[0] > 0 and all(m != 16 for m in v) for k, v in eng.runner.lane_one_call.items())
    for a, b in zip(one, chunked, strict=True):
        assert signature(a) == signature(b)
    eng.close()
    ref.close()


def test_lane_one_call_verdicts_hold_on_other_inputs() -> None:
    """The 8B shape's products in bf16: every size the probe lets run as one call (the
    chunk's multiples and sizes between and below them) gives every row of fresh inputs
    (other seed, other scale) the chunk's bits."""
    import torch

    from detserve.executor.gemm_classes import probe_lane_one_calls
    from detserve.executor.ops import run_in_row_chunks

    gen = torch.Generator(device="cuda").manual_seed(7)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
               for n, k in shapes]
    chunk = 176
    found = probe_lane_one_calls(weights, chunk, sorted({*range(32, 3 * chunk, 32), chunk,
                                                         2 * chunk, 3 * chunk}))
    for w in weights:
        sizes = found.get((w.shape[0], w.shape[1]), frozenset())
        for m in sizes:
            x = torch.randn(m, w.shape[1], device="cuda", generator=gen).to(torch.bfloat16) * 3
            ref = run_in_row_chunks(lambda c, w=w: torch.nn.functional.linear(c, w), x, chunk)
            assert torch.equal(torch.nn.functional.linear(x, w), ref)
    print("one-call sizes:", {k: sorted(v) for k, v in found.items()})


@pytest.mark.parametrize("chunk", [176, 0])
def test_decode_bucket_products_get_the_lane_chunks_bits(chunk: int) -> None:
    """The 8B shape's products in bf16, planned for a decode batch of 128 next to a 512-row
    lane in chunks of 176 rows or of the chunk the plan picks itself (0): at every decode
    bucket each product (padded on its own where the plan says) gives fresh rows the bits
    of a chunk-row call. Control: where the plan pads a product, the unpadded call gives
    other bits (the pad is needed)."""
    import torch

    from detserve.executor.gemm_classes import auto_alignment
    from detserve.executor.ops import TorchOps
    from detserve.executor.runner import PaddedProductOps

    gen = torch.Generator(device="cuda").manual_seed(11)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
               for n, k in shapes]
    al = auto_alignment(weights, 128, 512, chunk=chunk)
    print("chunk", al.chunk, "buckets", al.buckets, "pads", al.pads)
    ops = PaddedProductOps(TorchOps(), al.pads)
    for w in weights:
        x = torch.randn(al.chunk, w.shape[1], device="cuda", generator=gen).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        for b in al.buckets:
            assert torch.equal(ops.linear(x[:b], w), ref[:b]), (tuple(w.shape), b)
        for b in al.pads.get((w.shape[0], w.shape[1]), {}):
            assert not torch.equal(torch.nn.functional.linear(x[:b], w), ref[:b])


def test_portable_products_verdict_and_the_profiles_device(model: str) -> None:
    """The start-up probe's portability verdict is exactly "every product over the lane
    chunk's rows gives the Triton batch-invariant kernel's bits" (checked here on fresh
    inputs), and the profile names the device class where it holds, the card otherwise.
    Control: a product with one weight element nudged by an ulp-scale amount on cuBLAS's
    side only (the Triton side keeps the original) is not called portable."""
    import torch
    import triton

    from detserve.kernels.batch_invariant import matmul_bi
    from detserve.numerics import device_kind

    _, _, eng = run_engine(model, _reqs(det=True)[:2], **CUDA)
    al = eng.alignment
    assert al is not None
    weights, biases = eng.model.gemm_weights(), eng.model.gemm_biases()
    gen = torch.Generator(device="cpu").manual_seed(11)
    fresh = []
    for w, b in zip(weights, biases, strict=True):
        x = torch.randn(al.chunk, w.shape[1], generator=gen).to(w.device, w.dtype) * 2
        ours = torch.nn.functional.linear(x, w) if b is None else torch.nn.functional.linear(x, w, b)
        fresh.append(bool(torch.equal(ours, matmul_bi(x, w, b))))
    assert al.portable == all(fresh)
    assert eng.numerics.portable_products == al.portable
    prof = eng.determinism_profile()
    props = torch.cuda.get_device_properties(0)
    cls = device_kind("batch_invariant", "", (props.major, props.minor),
                      props.multi_processor_count, triton.__version__)
    assert prof["device"] == (cls if al.portable else torch.cuda.get_device_name(0))
    assert ("lane_products" in prof) == al.portable
    assert eng.scheduler.cfg.lane_max_wait_steps == 0  # (CUDA's default: prompts never wait)
    eng.close()


def test_portable_lane_gives_a_portable_chunk_or_refuses(model: str) -> None:
    """``portable_lane``: the engine starts only with a chunk whose products give the
    Triton kernel's bits (its profile then names the device class), and its deterministic
    outputs still equal ``lane_only``'s with the same option; where no chunk qualifies it
    refuses to start, naming why."""
    reqs = _reqs(det=True)
    try:
        dvr, _, eng = run_engine(model, reqs, perturbation=0.2, portable_lane=True, **CUDA)
    except ValueError as e:
        assert "portable" in str(e)
        return
    assert eng.alignment is not None and eng.alignment.portable
    assert eng.determinism_profile()["lane_products"] == "portable"
    eng.close()
    oracle, _, ref = run_engine(model, reqs, mode="lane_only", portable_lane=True, **CUDA)
    ref.close()
    for a, b in zip(oracle, dvr, strict=True):
        assert signature(a) == signature(b)
