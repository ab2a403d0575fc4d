"""Row-count classes of matrix products and the lane's GEMM chunk (CPU, fp32)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from detserve.executor.gemm_classes import (
    Alignment,
    auto_alignment,
    decode_buckets,
    joint_classes,
    lane_call_sizes,
    plan_alignment,
    probe_lane_one_calls,
    probe_sizes,
    row_classes,
    single_call_sizes,
)
from services.registry import DecoderRecord


def test_row_classes_partition_the_sizes() -> None:
    w = torch.randn(96, 80)
    sizes = [2, 4, 8, 16, 32, 64]
    classes = row_classes(w, sizes)
    assert sorted(m for c in classes for m in c) == sizes
    # members of one class really give identical first rows
    x = torch.randn(64, 80, generator=torch.Generator().manual_seed(0))
    for c in classes:
        ref = torch.nn.functional.linear(x[:c[0]], w)[:2]
        for m in c[1:]:
            assert torch.equal(torch.nn.functional.linear(x[:m], w)[:2], ref)


def test_row_classes_separate_different_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """A product whose bits change above 64 rows (as when cuBLAS switches algorithm) splits
    the sizes there, and the lane chunk stays in the reference's class."""
    import detserve.executor.gemm_classes as gc

    real = gc.F.linear

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = real(x, w)
        return out + 1e-3 if x.shape[0] > 64 else out  # "another algorithm" above 64 rows

    monkeypatch.setattr(gc.F, "linear", fake)
    w = torch.randn(32, 16)
    assert row_classes(w, [16, 32, 64, 128, 256]) == [[16, 32, 64], [128, 256]]


def test_row_classes_see_an_algorithm_that_changes_few_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another algorithm's sums differ from one only in the low bits, so a narrow product's
    rounded outputs show it in some rows only (a 128-column K/V head block on an H200: about
    one row in ten). Here calls of up to 16 rows change the rows whose first input exceeds
    1, which the probe's first row does not (the control: compared on that row alone, every
    size would be one class); ``PROBE_ROWS`` rows separate them."""
    import detserve.executor.gemm_classes as gc

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = x[:, :1] * w[:, 0]
        return out + 1e-3 * (x[:, :1] > 1) if x.shape[0] <= 16 else out

    monkeypatch.setattr(gc.F, "linear", fake)
    w = torch.randn(4, 8)
    sizes = [1, 2, 8, 16, 24, 64, 256]
    x = torch.randn(max(*sizes, gc.PROBE_ROWS), 8, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(fake(x[:m], w)[0], fake(x[:256], w)[0]) for m in sizes)  # control
    assert row_classes(w, sizes) == [[1, 2, 8, 16], [24, 64, 256]]
    # the eager steps' probe too: no size of the other algorithm runs as one call
    assert single_call_sizes(w, 32, 40) == frozenset(range(17, 41))


def test_lane_chunk_from_joint_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two weights with different switch points: only sizes in one class for both count."""
    import detserve.executor.gemm_classes as gc

    real = gc.F.linear

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        limit = 16 if w.shape[0] == 8 else 48
        out = real(x, w)
        return out + 1e-3 if x.shape[0] > limit else out

    monkeypatch.setattr(gc.F, "linear", fake)
    a, b = torch.randn(8, 4), torch.randn(12, 4)
    sizes = [8, 16, 24, 32, 40, 48, 56, 64]
    assert joint_classes([row_classes(a, sizes), row_classes(b, sizes)]) == [
        [8, 16], [24, 32, 40, 48], [56, 64]]


def test_row_classes_rejects_tiny_sizes() -> None:
    with pytest.raises(ValueError):
        row_classes(torch.randn(4, 4), [0, 2])


def test_lane_numerics_travel_whole_in_the_hello_and_the_record() -> None:
    """A remote verifier builds its runner from the decoder's ``LaneNumerics``: the hello's
    message names every field of the dataclass (nested sampler config included), the round
    trip through protobuf and through the registry's JSON is exact, and numerics no runner
    can be built from are refused."""
    import dataclasses
    import json

    from detserve.config import SamplerConfig
    from detserve.numerics import LaneNumerics
    from services.registry import numerics_from_dict
    from services.verifier import codec, verifier_pb2

    pb_fields = {f.name for f in verifier_pb2.LaneNumerics.DESCRIPTOR.fields}
    assert pb_fields == {f.name for f in dataclasses.fields(LaneNumerics)}
    assert ({f.name for f in verifier_pb2.SamplerConfig.DESCRIPTOR.fields}
            == {f.name for f in dataclasses.fields(SamplerConfig)})
    odd = LaneNumerics(verify_window=64, verify_group=8, block_size=32, batch_invariant_rows=16,
                       lane_gemm_rows=224, lane_one_calls=False, lane_dot_sums=False,
                       lane_full_tiles=False, aligned_decode_lane="32:4:2",
                       fused_silu_mul=False, fused_add_rmsnorm=False,
                       sampling=SamplerConfig(7, False, False))
    for n in (LaneNumerics(), odd):
        assert codec.decode_numerics(codec.encode_numerics(n)) == n
        assert numerics_from_dict(json.loads(json.dumps(dataclasses.asdict(n)))) == n
        rec = dataclasses.replace(_record(), numerics=n)
        assert DecoderRecord.from_json(rec.to_json()) == rec
        assert codec.decode_numerics(codec.encode_hello(rec).hello.numerics) == n
    with pytest.raises(ValueError):
        codec.decode_numerics(verifier_pb2.LaneNumerics(verify_window=64))  # (group 0)
    with pytest.raises(ValueError):
        LaneNumerics(lane_gemm_rows=-1)
    with pytest.raises(ValueError, match="verify_window"):
        LaneNumerics(verify_window=0)


def test_engine_numerics_reach_the_runner_and_the_record() -> None:
    """A decoder with other numerics than the defaults (plain sums, torch's SiLU and add,
    no logprob kernel) hands them to its runner whole, and so to its verifier's hello."""
    import dataclasses

    from detserve.engine import LLMEngine
    from services.verifier import codec

    eng = LLMEngine.from_args("random:tiny", "llm42", fused_silu_mul=False, lane_dot_sums=False,
                              fused_add_rmsnorm=False, logprob_kernel=False)
    n = eng.runner.numerics
    eng.close()
    assert n is eng.numerics and not (n.lane_dot_sums or n.fused_silu_mul
                                      or n.fused_add_rmsnorm or n.sampling.logprob_kernel)
    assert not eng.runner.sampling.logprob_kernel and not eng.runner.lane_attn.dot_sums
    assert (n.lane_rows, n.verify_window) == (eng.runner.lane_rows, eng.runner.window)
    rec = dataclasses.replace(_record(), numerics=n)
    assert codec.decode_numerics(codec.encode_hello(rec).hello.numerics) == n
    default = LLMEngine.from_args("random:tiny", "llm42")
    d = default.runner.numerics
    default.close()
    assert d.fused_silu_mul and d.fused_add_rmsnorm and d.lane_dot_sums
    assert d.sampling.logprob_kernel  # on by default
    with pytest.raises(ValueError, match="gumbel_chunk_rows"):
        LLMEngine.from_args("random:tiny", "llm42", gumbel_chunk_rows=-1)


def _record() -> DecoderRecord:
    from detserve.numerics import LaneNumerics
    from services.kv_handle import KVHandle

    handle = KVHandle("shm", "detserve-test", (2, 2, 8, 16, 2, 8), "float32", "cpu", 1, "d0")
    return DecoderRecord("d0", 1, handle, "w" * 16,
                         LaneNumerics(verify_window=8, verify_group=8), "torch-ref-1")


def test_aligned_decode_lane_is_parsed_and_checked() -> None:
    """The fast path's decode-row config of the lane kernel: "BLOCK_M:NUM_WARPS:NUM_STAGES"
    over the lane's tile and split; bad specs are refused where the config is made."""
    from detserve.config import EngineConfig
    from detserve.engine import LLMEngine
    from detserve.kernels.config import TABLE, LaneConfig, lane_variant

    assert lane_variant(TABLE.lane, "") is TABLE.lane
    got = lane_variant(LaneConfig(tile=32), "16:1:2")
    assert got == LaneConfig(tile=32, block_m=16, num_warps=1, num_stages=2)
    for bad in ("16:1", "a:1:2", "12:4:2", "16:3:2", "8:1:2", "16:1:0"):
        with pytest.raises(ValueError, match="aligned_decode_lane"):
            EngineConfig.create("random:tiny", aligned_decode_lane=bad)
    eng = LLMEngine.from_args("random:tiny", "llm42", aligned_decode_lane="32:4:2")
    assert eng.runner.lane_attn == TABLE.lane  # the lane keeps its own
    assert (eng.runner.decode_attn.block_m, eng.runner.decode_attn.num_stages) == (32, 2)
    eng.close()
    auto = lane_variant(TABLE.lane, "auto")  # with dot sums: the one-row kernel's tile
    assert TABLE.lane.dot_sums and (auto.block_m, auto.num_warps, auto.num_stages) == (16, 2, 3)
    assert lane_variant(replace(TABLE.lane, dot_sums=False), "auto") == replace(
        TABLE.lane, dot_sums=False)  # without: the lane's own, the only tile sure to agree


def test_fused_ops_are_on_by_default_and_a_cuda_matter() -> None:
    """``fused_silu_mul`` and ``fused_add_rmsnorm`` reach the runner; on CPU the ops stay
    torch's, so the kernel set and the output do not change."""
    from detserve.config import EngineConfig
    from detserve.engine import LLMEngine
    from detserve.params import SamplingParams

    assert EngineConfig.fused_silu_mul is True and EngineConfig.fused_add_rmsnorm is True
    outs = []
    for fused in (False, True):
        eng = LLMEngine.from_args("random:tiny", "llm42", fused_silu_mul=fused,
                                  fused_add_rmsnorm=fused, seed=0)
        assert eng.runner.kernel_set == "torch-ref-1"
        assert eng.runner.numerics.fused_add_rmsnorm is fused
        eng.add_request("r", None, SamplingParams(max_tokens=6, is_deterministic=True),
                        prompt_token_ids=[1, 2, 3, 4])
        while eng.has_unfinished_requests():
            outs += [o.token_ids for o in eng.step() if o.finished]
        eng.close()
    assert len(outs) == 2 and outs[0] == outs[1]


# Classes measured on an H100 for the Llama-3.1-8B shapes (o_proj splits at 24 rows, down_proj
# has 128 alone and switches again from 192), as joint classes over the probe sizes.
H100_8B = [[1], [2, 4, 8, 16], [24, 32, 40, 48, 56, 64, 80, 96, 112, 160, 224], [128],
           [192, 256, 320, 384, 448, 512]]


def test_alignment_prefers_the_class_that_runs_the_lane_pass_in_one_call() -> None:
    """The class from 192 holds the whole 512-row pass (one read of each weight against
    three 224-row calls in the class from 24) and starts within twice the full batch: it
    wins. Its chunk is the member whose multiples up to the pass are all members, nearest
    half a pass (256: passes up to half full run 256 rows); every bucket rounds into it."""
    al = plan_alignment(H100_8B, 128, 512, decode_buckets(128))
    assert al.chunk == 256
    assert al.buckets == (192,)
    assert all(al.bucket(n) == 192 for n in range(1, 129))


def test_alignment_keeps_small_batches_out_of_a_class_far_above_them() -> None:
    """With a full batch of 64, the class from 192 would pad every decode to three times
    the batch: the class from 24 wins while it holds a full batch, and covers the pass in
    the fewest calls of its largest member (224, no chain of multiples there)."""
    assert plan_alignment(H100_8B, 64, 512, decode_buckets(64)).chunk == 224
    # a full batch of 256 fits only the 192.. class
    al = plan_alignment(H100_8B, 256, 512, decode_buckets(256))
    assert al.chunk == 256 and al.buckets[0] == 192
    # the old rule (smallest member first) is what a class far above the batch still gets
    assert plan_alignment(H100_8B, 128, 512, decode_buckets(128), chunk=224).buckets == (
        24, 32, 40, 48, 56, 64, 80, 96, 112, 160)


def test_alignment_with_one_class_keeps_the_plain_buckets() -> None:
    sizes = probe_sizes(128, 512)
    al = plan_alignment([sizes], 128, 512, decode_buckets(128))
    assert al == Alignment(256, tuple(decode_buckets(128)))


def test_alignment_with_a_given_chunk_and_without_a_full_class() -> None:
    al = plan_alignment(H100_8B, 128, 512, decode_buckets(128), chunk=128)
    assert al.chunk == 128 and al.buckets[-1] == 128  # 128's class is {128}: buckets pad to it
    small = [[1], [2, 4, 8], [16, 24, 32]]  # nothing holds a batch of 64: largest class
    al = plan_alignment(small, 64, 64, decode_buckets(64))
    assert al.chunk == 32 and al.buckets[-1] == 64  # sizes past the class stay as they were


def test_probe_sizes_cover_every_bucket_and_the_lane() -> None:
    sizes = probe_sizes(128, 512)
    assert set(decode_buckets(128)) <= set(sizes) and 512 in sizes and sizes[0] == 1
    assert probe_sizes(100, 60)[-1] == 100


def test_auto_alignment_probes_the_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on CPU: a product whose bits change above 8 rows; every bucket lands in
    the class above 8, whose chunk is half the lane (its multiple, the whole lane, is a
    member too)."""
    import detserve.executor.gemm_classes as gc

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = x[:, :1] * w[:, 0]  # elementwise: exact at every M (CPU BLAS is not, at M=2)
        return out + 1e-3 if x.shape[0] > 8 else out  # "another algorithm" above 8 rows

    monkeypatch.setattr(gc.F, "linear", fake)
    al = auto_alignment([torch.randn(16, 8)], 32, 64)
    assert al.chunk == 32
    assert al.buckets == (9, 16, 24, 32)
    assert not al.portable  # (the Triton kernel it is checked against needs a GPU)
    assert auto_alignment([torch.randn(16, 8)], 32, 64, chunk=8).buckets == (1, 2, 4, 8, 16, 24, 32)


def test_shared_chunk_is_planned_from_every_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """``shared_chunk`` (the TP-invariant lane's): the chunk ``auto_alignment`` plans for
    real weights of the given shapes, probed on stand-ins of those shapes, so engines whose
    own shapes differ (TP sizes) but that pass the same shapes get one chunk. Planned from
    one shape alone, as an engine at another TP size would, the chunk differs here."""
    import detserve.executor.gemm_classes as gc

    def fake(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = x[:, :1] * w[:, 0]  # elementwise: exact at every M
        limit = 40 if w.shape[0] == 16 else 24  # each shape switches algorithm elsewhere
        return out + 1e-3 if x.shape[0] > limit else out

    monkeypatch.setattr(gc.F, "linear", fake)
    shapes = [(16, 8), (24, 8)]
    both = gc.shared_chunk(shapes + shapes[::-1], 32, 64, "cpu", torch.float32)
    assert both == auto_alignment([torch.randn(*s) for s in shapes], 32, 64).chunk
    alone = auto_alignment([torch.randn(24, 8)], 32, 64).chunk
    assert alone != both


def test_head_padded_ops_split_the_decode_rows_from_the_rest() -> None:
    """Eager fast steps: the leading decode rows' products run as one call of the padded
    size, the prefill rows as another; the values are unchanged."""
    from detserve.executor.ops import TorchOps
    from detserve.executor.runner import HeadPaddedOps

    calls: list[int] = []

    class Recording(TorchOps):
        def linear(self, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
            calls.append(x.shape[0])
            return super().linear(x, weight, bias)

    x, w = torch.randn(10, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    counts: Counter[str] = Counter()
    out = HeadPaddedOps(Recording(), 3, 8, counts=counts).linear(x, w)
    assert calls == [8, 7] and counts == {"split": 1}
    assert torch.allclose(out, x @ w.T)
    calls.clear()
    ops = HeadPaddedOps(Recording(), 3, 8, counts=counts)
    assert torch.allclose(ops.linear(x[:3], w), x[:3] @ w.T)
    assert calls == [8] and counts == {"split": 1, "one": 1}
    calls.clear()  # a row count the probe found single-call safe: one call over all rows
    ops = HeadPaddedOps(Recording(), 3, 8, {(5, 6): frozenset({10})}, counts)
    assert torch.allclose(ops.linear(x, w), x @ w.T)
    assert calls == [10] and counts == {"split": 1, "one": 2}
    with pytest.raises(ValueError):
        HeadPaddedOps(TorchOps(), 4, 2)


def _switches_above(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Products exact at every M (elementwise), with "another algorithm" above ``limit``
    rows that changes every row's bits."""
    import detserve.executor.gemm_classes as gc

    def fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = x[:, :1] * w[:, 0]
        return out + 1e-3 if x.shape[0] > limit else out

    monkeypatch.setattr(gc.F, "linear", fake)


def test_single_call_sizes_are_the_chunks_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step size up to the switch runs the chunk's arithmetic; none above it does."""
    _switches_above(64, monkeypatch)
    w = torch.randn(16, 8)
    assert single_call_sizes(w, 32, 100) == frozenset(range(1, 65))
    assert single_call_sizes(w, 80, 100) == frozenset(range(65, 101))
    with pytest.raises(ValueError):
        single_call_sizes(w, 0, 10)


def test_auto_alignment_probes_step_sizes_per_weight_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _switches_above(64, monkeypatch)
    w1, w2 = torch.randn(16, 8), torch.randn(24, 8)
    al = auto_alignment([w1, w2], 32, 64, step_rows=[100, 40])
    assert al.chunk == 32  # one class up to 64: half the pass, 64 its multiple
    assert al.single_call == {(16, 8): frozenset(range(1, 65)), (24, 8): frozenset(range(1, 41))}
    assert auto_alignment([w1, w2], 32, 64).single_call == {}  # not asked: nothing probed


def test_mixed_step_decode_rows_keep_the_chunks_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager step's leading decode rows get the lane chunk's bits whatever its size: one
    call where the probe found the chunk's algorithm, else split. Negative control: a
    single-call table that wrongly lists a size past the switch changes the decode rows."""
    import detserve.executor.gemm_classes as gc
    from detserve.executor.ops import TorchOps
    from detserve.executor.runner import HeadPaddedOps

    _switches_above(64, monkeypatch)

    calls: list[int] = []

    class Recording(TorchOps):
        def linear(self, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
            calls.append(x.shape[0])
            return gc.F.linear(x, weight)

    w = torch.randn(16, 8)
    chunk, head, bucket = 32, 10, 16
    single = {(16, 8): single_call_sizes(w, chunk, 128)}
    for total, want_calls in ((40, [40]), (100, [bucket, 90])):
        x = torch.randn(total, 8)
        lane = gc.F.linear(torch.cat([x[:head], torch.zeros(chunk - head, 8)]), w)[:head]
        calls.clear()
        out = HeadPaddedOps(Recording(), head, bucket, single).linear(x, w)
        assert calls == want_calls
        assert torch.equal(out[:head], lane)
    wrong = {(16, 8): frozenset({100})}
    x = torch.randn(100, 8)
    lane = gc.F.linear(torch.cat([x[:head], torch.zeros(chunk - head, 8)]), w)[:head]
    assert not torch.equal(HeadPaddedOps(Recording(), head, bucket, wrong).linear(x, w)[:head],
                           lane)


def test_probes_run_the_product_with_its_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bias can change cuBLAS's algorithm (an addmm epilogue): the probes call the product
    as the model does, bias included, and find the switch only it has."""
    import detserve.executor.gemm_classes as gc

    def fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = x[:, :1] * w[:, 0]
        if bias is None:
            return out
        return out + bias + (1e-3 if x.shape[0] > 64 else 0.0)

    monkeypatch.setattr(gc.F, "linear", fake)
    w, b = torch.randn(16, 8), torch.randn(16)
    assert single_call_sizes(w, 32, 100) == frozenset(range(1, 101))
    assert single_call_sizes(w, 32, 100, bias=b) == frozenset(range(1, 65))
    assert row_classes(w, [16, 128], bias=b) == [[16], [128]]
    al = auto_alignment([w, torch.randn(24, 8)], 32, 64, step_rows=[100, 0], biases=[b])
    assert al.single_call == {(16, 8): frozenset(range(1, 65))}


def test_lane_call_sizes_find_the_chunks_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every size but the chunk is a candidate (multiples of it, sizes between, sizes below
    it), and only those up to the algorithm switch give every row the chunk's bits."""
    _switches_above(64, monkeypatch)
    w = torch.randn(16, 8)
    assert lane_call_sizes(w, 16, [16, 32, 48, 64, 80, 96, 40, 8]) == frozenset({8, 32, 40, 48, 64})
    assert lane_call_sizes(w, 96, [96]) == frozenset()
    # a chunk past the switch: the sizes past it share its algorithm, those below do not
    assert lane_call_sizes(w, 80, [40, 64, 72, 160]) == frozenset({72, 160})
    with pytest.raises(ValueError):
        lane_call_sizes(w, 0, [32])


def test_lane_call_sizes_check_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call whose rows past the first chunk differ (another tile path for them) is not
    listed, though its first rows agree."""
    import detserve.executor.gemm_classes as gc

    def fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = x[:, :1] * w[:, 0]
        if x.shape[0] > 32:
            out = out.clone()
            out[32:] += 1e-3
        return out

    monkeypatch.setattr(gc.F, "linear", fake)
    assert lane_call_sizes(torch.randn(16, 8), 16, [32, 48, 64]) == frozenset({32})


def test_lane_one_calls_per_weight_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights of one shape keep the sizes all of them allow; shapes with none are left out."""
    import detserve.executor.gemm_classes as gc

    def fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = x[:, :1] * w[:, 0]
        limit = 32 if w.shape[0] == 24 else 64
        return out + 1e-3 if x.shape[0] > limit else out

    monkeypatch.setattr(gc.F, "linear", fake)
    got = probe_lane_one_calls([torch.randn(16, 8), torch.randn(24, 8), torch.randn(16, 8)],
                               16, [16, 32, 48, 64])
    assert got == {(16, 8): frozenset({32, 48, 64}), (24, 8): frozenset({32})}
    assert probe_lane_one_calls([torch.randn(24, 8)], 32, [32, 64]) == {}


def test_lane_products_run_one_call_only_where_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``linear_in_row_chunks``: a listed padded size runs as one call, with the chunked
    call's bits where the probe listed it; an unlisted one runs chunk by chunk. Negative
    control: a table that wrongly lists a size past the algorithm switch changes the rows."""
    import detserve.executor.gemm_classes as gc
    import detserve.executor.ops as ops_mod

    _switches_above(64, monkeypatch)
    calls: list[int] = []
    fake = gc.F.linear

    def recording(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return fake(x, w, bias)

    monkeypatch.setattr(ops_mod.F, "linear", recording)
    w = torch.randn(16, 8)
    x = torch.randn(40, 8)
    chunked = ops_mod.run_in_row_chunks(lambda c: fake(c, w), x, 16)
    table = {(16, 8): lane_call_sizes(w, 16, [32, 48, 64, 80])}
    assert table[(16, 8)] == frozenset({32, 48, 64})
    calls.clear()
    out = ops_mod.linear_in_row_chunks(x, w, None, 16, table)
    assert calls == [48] and torch.equal(out, chunked)
    calls.clear()
    assert torch.equal(ops_mod.linear_in_row_chunks(x, w, None, 16, {}), chunked)
    assert calls == [16, 16, 16]
    calls.clear()
    assert torch.equal(ops_mod.linear_in_row_chunks(x[:10], w, None, 16, table), chunked[:10])
    assert calls == [16]  # one chunk's rows: as before, padded to exactly the chunk
    # sizes between the chunk's multiples: the smallest listed one that holds the rows, as
    # long as it is no larger than the rows' chunks
    between = {(16, 8): lane_call_sizes(w, 16, [24, 40, 56])}
    assert between[(16, 8)] == frozenset({24, 40, 56})
    xx = torch.cat([x, x])
    for n, want in ((36, [40]), (40, [40]), (20, [24]), (50, [56]), (60, [16] * 4), (10, [16])):
        calls.clear()
        got = ops_mod.linear_in_row_chunks(xx[:n], w, None, 16, between)
        assert torch.equal(got, ops_mod.run_in_row_chunks(lambda c: fake(c, w), xx[:n], 16))
        assert calls == want, n
    y = torch.randn(70, 8)
    wrong = {(16, 8): frozenset({80})}
    assert not torch.equal(ops_mod.linear_in_row_chunks(y, w, None, 16, wrong),
                           ops_mod.run_in_row_chunks(lambda c: fake(c, w), y, 16))


def test_product_pads_pad_only_the_products_whose_class_needs_it() -> None:
    """As the 8B products on an H100: a 128-row decode bucket is in the chunk's class for
    every product but one, which alone runs 136 rows; a bucket that every product would pad
    is rounded up as a whole, and one past every class stays as it is."""
    from detserve.executor.gemm_classes import plan_product_pads

    a, b = (16, 8), (24, 8)
    per_weight = [[[8, 16, 128, 136, 176]], [[8, 16], [128], [136, 176]]]
    plan = Alignment(176, (136,))
    al = plan_product_pads(per_weight, [a, b], plan, [8, 16, 128])
    assert al.chunk == 176 and al.buckets == (8, 16, 128)
    assert al.pads == {b: {8: 136, 16: 136, 128: 136}}
    both = [[[8], [136, 176]], [[8, 16], [136, 176]]]
    assert plan_product_pads(both, [a, b], plan, [8, 128]) == Alignment(176, (136,))
    assert plan_product_pads(per_weight, [a, b], plan, [200]) == Alignment(176, (200,))
    # two weights of one shape: the product pads to a member of both their classes
    three = [*per_weight, [[8, 16, 128], [136], [176]]]
    assert plan_product_pads(three, [a, b, b], plan, [128]).pads == {b: {128: 176}}


def test_padded_product_ops_run_listed_products_on_more_rows() -> None:
    """A listed (shape, rows) product runs on its padded row count through one reused zeroed
    buffer and gives the rows' own results; other products and row counts run as they are."""
    from detserve.executor.ops import TorchOps
    from detserve.executor.runner import PaddedProductOps

    calls: list[int] = []

    class Recording(TorchOps):
        def linear(self, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
            calls.append(x.shape[0])
            assert x.shape[0] != 16 or torch.count_nonzero(x[10:]) == 0  # zero pad rows
            return torch.nn.functional.linear(x, weight, bias)

    ops = PaddedProductOps(Recording(), {(5, 8): {10: 16}})
    w, other, x = torch.randn(5, 8), torch.randn(7, 8), torch.randn(12, 8)
    first = ops.linear(x[:10], w)
    second = ops.linear(x[2:], w)  # other rows, same count: the same buffer, rewritten
    assert calls == [16, 16] and len(ops._buffers) == 1
    assert torch.allclose(first, x[:10] @ w.T) and torch.allclose(second, x[2:] @ w.T)
    calls.clear()
    ops.linear(x[:10], other)
    ops.linear(x[:9], w)
    assert calls == [10, 9]
    # the activation writes its rows straight into the buffer of the product that reads it
    down = torch.randn(5, 6)
    acts = PaddedProductOps(Recording(), {(5, 6): {4: 16}})
    gate_up = torch.randn(4, 12)
    h = acts.silu_mul(gate_up)
    buf = acts._buffers[(6, 4, 16)]
    assert h.data_ptr() == buf.data_ptr() and torch.count_nonzero(buf[4:]) == 0
    assert torch.equal(h, torch.nn.functional.silu(gate_up[:, :6]) * gate_up[:, 6:])
    calls.clear()
    assert torch.allclose(acts.linear(h, down), h @ down.T) and calls == [16]
    assert acts.silu_mul(gate_up[:3]).data_ptr() != buf.data_ptr()  # 3 rows: not listed
    # eager steps: a head padded to its bucket runs this product on the bucket's pad
    from detserve.executor.runner import HeadPaddedOps

    calls.clear()
    out = HeadPaddedOps(Recording(), 3, 10, pads={(5, 8): {10: 16}}).linear(x, w)
    assert calls == [16, 9] and torch.allclose(out, x @ w.T, atol=1e-6)
    calls.clear()
    HeadPaddedOps(Recording(), 3, 10, pads={(5, 8): {10: 16}}).linear(x, other)
    assert calls == [10, 9]


def test_padded_product_ops_write_the_activation_through_the_bases_own() -> None:
    """The activation goes into the padded buffer through the base's silu_mul (a GPU base
    may run a fused kernel there), and only for bases whose silu_mul takes an ``out``:
    a FixedShapeOps base (chunked, no ``out``) gets the rows back as it computes them."""
    from detserve.executor.ops import FixedShapeOps, TorchOps
    from detserve.executor.runner import PaddedProductOps

    seen: list[torch.Tensor | None] = []

    class Own(TorchOps):
        def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            seen.append(out)
            return super().silu_mul(gate_up, out=out)

    gate_up = torch.randn(4, 12)
    want = torch.nn.functional.silu(gate_up[:, :6]) * gate_up[:, 6:]
    ops = PaddedProductOps(Own(), {(5, 6): {4: 16}})
    h = ops.silu_mul(gate_up)
    buf = ops._buffers[(6, 4, 16)]
    assert len(seen) == 1 and seen[0] is not None and seen[0].data_ptr() == buf.data_ptr()
    assert h.data_ptr() == buf.data_ptr() and torch.equal(h, want)
    chunked = PaddedProductOps(FixedShapeOps(8), {(5, 6): {4: 16}})
    h = chunked.silu_mul(gate_up)
    assert not chunked._buffers and torch.equal(h, want)


def test_lane_sizes_are_the_chunks_multiples() -> None:
    """A pass runs at the GEMM chunk's multiples up to the pass (the last one may pass it),
    the smallest that holds its rows; without a chunk, at the whole pass."""
    from detserve.numerics import LaneNumerics, lane_run_rows

    n = LaneNumerics(verify_window=64, verify_group=8, lane_gemm_rows=176)
    assert n.lane_sizes == (176, 352, 528)
    assert [lane_run_rows(n.lane_sizes, u) for u in (1, 176, 177, 512)] == [176, 176, 352, 528]
    assert LaneNumerics().lane_sizes == (512,)


def test_a_portable_lane_chooses_only_chunks_with_the_portable_kernels_bits() -> None:
    """``portable``: only chunks that give the Triton kernel's bits are chosen from, and
    the classes that hold one. Shaped as the 8B shape's on an H200: the near class (the
    probed 256) has none; the portable chunk 512 lies in a class starting above twice the
    decode batch, and the fast path's buckets pad into it. None qualifying: refused."""
    classes = [[64, 128, 256], [320, 512]]
    plain = plan_alignment(classes, 128, 512, [8, 64, 128])
    assert plain.chunk == 256 and plain.buckets == (64, 128)
    portable = plan_alignment(classes, 128, 512, [8, 64, 128], portable=lambda c: c >= 320)
    assert portable.chunk == 512 and portable.buckets == (320,)
    assert plan_alignment(classes, 128, 512, [8], portable=lambda c: c in (128, 512)).chunk == 128
    with pytest.raises(ValueError, match="portable"):
        plan_alignment(classes, 128, 512, [8], portable=lambda c: False)
    # on CPU no chunk can be checked against the Triton kernel: the engine refuses at once
    with pytest.raises(ValueError, match="portable"):
        auto_alignment([torch.randn(16, 8)], 32, 64, portable=True)
    from detserve.config import EngineConfig

    with pytest.raises(ValueError, match="portable_lane needs a CUDA device"):
        EngineConfig.create("random:tiny", portable_lane=True, dtype="float32")
