"""Tensor parallelism on CPU over gloo (issue 36): the shard layout, TP=2 against TP=1,
the TP-invariant lane (bit for bit across TP sizes) with its negative control, a
SmolLM2-shaped model whose K/V heads do not split, and a lost worker."""

from __future__ import annotations

import os
import signal
import time
from typing import cast

import pytest
import torch
from engine_utils import as_tokens, random_prompts, signature, tiny_model

from detserve.config import EngineConfig
from detserve.distributed import Group
from detserve.executor.ops import TorchOps
from detserve.executor.runner import PaddedProductOps
from detserve.llm import LLM
from detserve.model.config import ModelConfig
from detserve.model.llama import LlamaModel, RowReduce
from detserve.model.loader import load_model
from detserve.numerics import LaneNumerics
from detserve.outputs import RequestOutput
from detserve.parallel.executor import TensorParallelError
from detserve.parallel.layout import TPLayout, cut, tree_leaves, tree_shapes
from detserve.parallel.shard import leaf_columns, shard_model, tree_sum, tree_twin
from detserve.params import SamplingParams

# 9 query heads in 3 K/V groups, as SmolLM2-135M has them (head_dim 16 here); a vocabulary
# that splits unevenly (258 + 257 rows at TP=2)
SMOLLM2_HEADS = {"hidden_size": 144, "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 96,
                 "vocab_size": 515}
# K/V heads that split over the tree's 4 leaves (as Llama 3's 8): the tree keeps each
# leaf's query, K and V rows together and runs one qkv call a leaf
KV_BY_LEAF = {"hidden_size": 128, "num_heads": 8, "num_kv_heads": 4}
LANE = {"verify_window": 8, "verify_group": 4, "max_model_len": 256}


def _config(**kw: int) -> ModelConfig:
    base = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


# ---- the layout (no processes) ------------------------------------------------------

def test_smollm2_heads_at_tp2_replicate_the_straddling_kv_head() -> None:
    c = _config(num_heads=9, num_kv_heads=3, hidden_size=144)
    r0, r1 = TPLayout(c, 2, 0), TPLayout(c, 2, 1)
    assert (r0.heads, r1.heads) == ((0, 4), (4, 9))
    # rank 0: query heads 0-2 read K/V head 0, head 3 reads K/V head 1; rank 1: 4-5 -> 1,
    # 6-8 -> 2. The groups straddle the cut, so each local query head gets its own copy
    assert r0.kv_heads == (0, 0, 0, 1) and r1.kv_heads == (1, 1, 2, 2, 2)
    assert (r0.group, r1.group) == (1, 1)
    local = r1.local_config()
    assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (5, 5, 512)


def test_divisible_heads_are_not_replicated() -> None:
    c = _config(num_heads=32, num_kv_heads=8, hidden_size=512)
    for size in (1, 2, 4, 8):
        kv = [TPLayout(c, size, r).kv_heads for r in range(size)]
        assert [h for part in kv for h in part] == list(range(8))
    # more ranks than K/V heads: each K/V head on the ranks whose query heads read it
    assert [TPLayout(c, 16, r).kv_heads for r in range(16)] == [(r // 2,) for r in range(16)]


@pytest.mark.parametrize("n", [2, 9, 10, 64, 96, 128])
def test_tree_leaves_are_the_same_cuts_at_every_tp_size(n: int) -> None:
    """The invariant lane's leaves, in absolute units, do not depend on the TP size, and
    a rank's range is the union of its leaves: the top levels of the tree are the split."""
    def absolute(size: int) -> list[tuple[int, int]]:
        out = []
        for r in range(size):
            first = cut(n, size, r)[0]
            out += [(first + a, first + b) for a, b in TPLayout(_config(), size, r).leaves(n)]
        return out
    assert tree_leaves(1) == tree_leaves(2) == tree_leaves(4)
    assert absolute(1) == absolute(2) == absolute(4) == [cut(n, 4, j) for j in range(4)]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        TPLayout(_config(), 3, 0)
    with pytest.raises(ValueError, match="query heads"):
        TPLayout(_config(num_heads=2, num_kv_heads=2), 4, 0)
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig.create("m", dtype="float32", max_model_len=64, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="dividing 4"):
        EngineConfig.create("m", dtype="float32", tensor_parallel_size=8, tp_invariant_lane=True,
                            max_model_len=64)
    # on CUDA at TP>1 the lane runs in the engine's thread (threads stalled NCCL's ranks)
    for kw in ({"lane_threaded": True}, {"lane_sms": 16}):
        with pytest.raises(ValueError, match="engine's thread"):
            EngineConfig.create("m", dtype="bfloat16", device="cuda", tensor_parallel_size=2,
                                max_model_len=64, **kw)
        EngineConfig.create("m", dtype="bfloat16", device="cuda", max_model_len=64, **kw)
    from detserve.engine import LLMEngine
    from detserve.verifier import InProcessVerifier
    cuda_tp = EngineConfig.create("m", dtype="bfloat16", device="cuda", tensor_parallel_size=2,
                                  max_model_len=64)
    assert LLMEngine._default_verifier_factory(cuda_tp) is InProcessVerifier


def test_in_process_verifier_never_waits_on_a_pass_unless_asked() -> None:
    """On CUDA at TP>1 the lane shares the engine's thread: submit only queues a pass, poll
    decides those whose results are back, in submission order, and waits only when told."""
    from detserve.verifier import InProcessVerifier

    class Launch:
        def __init__(self, i: int) -> None:
            self.i, self.done, self.read = i, False, False

        def ready(self) -> bool:
            return self.done

        def finish(self) -> int:
            self.read = True  # (a real launch waits here for the device)
            return self.i

    launches: list[Launch] = []

    class Runner:
        def launch_lane(self, lane_pass: int) -> Launch:
            launches.append(Launch(lane_pass))
            return launches[-1]

    v = InProcessVerifier(Runner())  # type: ignore[arg-type]
    for i in range(3):
        v.submit(i)  # type: ignore[arg-type]
    assert v.in_flight() == 3 and v.poll() == [] and not any(x.read for x in launches)
    launches[1].done = True
    assert v.poll() == []  # the first pass decides first
    launches[0].done = True
    assert v.poll() == [0, 1] and v.in_flight() == 1
    assert v.poll(wait=True) == [2] and v.in_flight() == 0  # waited for the one left
    assert v.poll(wait=True) == []


def test_tp_engine_refuses_an_outside_verifier() -> None:
    from detserve.engine import LLMEngine
    from detserve.verifier import InProcessVerifier

    config = EngineConfig.create(tiny_model(), dtype="float32", max_model_len=64,
                                 tensor_parallel_size=2)
    with pytest.raises(ValueError, match="outside verifier"):
        LLMEngine(config, verifier_factory=InProcessVerifier)


def test_tree_at_tp1_is_the_product_summed_over_leaves() -> None:
    model, _, _ = load_model(tiny_model(), dtype="float32")
    layer = model.layer_list[0]
    x = torch.randn(5, layer.o_proj.shape[1])
    whole = TorchOps().linear(x, layer.o_proj)
    local = shard_model(model, TPLayout(model.config, 1, 0), None, tree=True)
    assert local.parallel is not None
    tree = local.parallel.row_linear(TorchOps(), x, layer.o_proj, "tree")
    plain = local.parallel.row_linear(TorchOps(), x, layer.o_proj, "ordered")
    assert torch.equal(plain, whole)
    torch.testing.assert_close(tree, whole, rtol=1e-5, atol=1e-6)
    parts = [x[:, a:b] @ layer.o_proj[:, a:b].T for a, b in ((0, 16), (16, 32), (32, 48), (48, 64))]
    assert torch.equal(tree, tree_sum(parts))


@pytest.mark.parametrize("ranges", [[(0, 4), (4, 8), (8, 12)], [(0, 5), (5, 8), (8, 12)]])
def test_leaf_inputs_are_each_leafs_columns(ranges: list[tuple[int, int]]) -> None:
    """The tree's leaf inputs (one copy for equal leaves, one per leaf otherwise) hold each
    leaf's K columns as contiguous tensors."""
    x = torch.randn(3, 12)
    for got, (a, b) in zip(leaf_columns(x, ranges), ranges, strict=True):
        assert got.is_contiguous() and torch.equal(got, x[:, a:b])
    assert [t.shape for t in leaf_columns(x.t().contiguous().t(), ranges)] == [
        (3, b - a) for a, b in ranges]  # (a non-contiguous x: one copy a leaf)


def test_padded_leaf_products_take_each_leafs_own_activation() -> None:
    """An alignment may pad the tree's down_proj leaves on the fast path's aligned rows
    (``PaddedProductOps``), whose activation writes straight into the padded product's
    buffer, one buffer per width: each leaf's product must read its own leaf's activation.
    (On GPUs, when all the leaves' activations were computed before their products, every
    leaf read the last one's, and 98 % of the TP=2 invariant lane's windows rolled back.)
    The MLP under the tree and without it (gate/up kept leaf by leaf) is the plain one."""
    model, _, _ = load_model(tiny_model(), dtype="float32")
    c = model.config
    gate_up = model.layer_list[0].gate_up_proj.detach().clone()  # (before the tree's order)
    local = shard_model(model, TPLayout(c, 1, 0), None, tree=True)
    assert local.parallel is not None
    layer = local.layer_list[0]
    x = torch.randn(5, c.hidden_size)
    tp = local.parallel
    plain = tp.mlp(TorchOps(), x, layer.gate_up_proj, layer.down_proj, "tree")
    padded_ops = PaddedProductOps(TorchOps(), {(c.hidden_size, c.intermediate_size // 4): {5: 8}})
    padded = tp.mlp(padded_ops, x, layer.gate_up_proj, layer.down_proj, "tree")
    assert padded_ops._buffers, "the activation went through the padded buffer"
    torch.testing.assert_close(padded, plain)
    ops = TorchOps()
    whole = ops.linear(ops.silu_mul(ops.linear(x, gate_up)), layer.down_proj)
    torch.testing.assert_close(plain, whole, rtol=1e-5, atol=1e-6)
    assert torch.equal(tp.mlp(ops, x, layer.gate_up_proj, layer.down_proj, "ordered"), whole)


def test_the_mlp_with_unequal_leaves_is_the_plain_one() -> None:
    """130 MLP columns make leaves of 32 and 33: gate/up, kept leaf by leaf, is read one
    leaf at a time off the tree too, and both give the plain MLP's outputs."""
    model, _, _ = load_model(tiny_model(intermediate_size=130), dtype="float32")
    c, layer = model.config, model.layer_list[0]
    gate_up = layer.gate_up_proj.detach().clone()
    local = shard_model(model, TPLayout(c, 1, 0), None, tree=True)
    assert local.parallel is not None
    x, ops = torch.randn(5, c.hidden_size), TorchOps()
    whole = ops.linear(ops.silu_mul(ops.linear(x, gate_up)), layer.down_proj)
    for reduce in ("tree", "ordered"):
        got = local.parallel.mlp(ops, x, layer.gate_up_proj, layer.down_proj, reduce)
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)


def test_the_alignment_probe_sees_the_trees_leaf_products() -> None:
    """With the tree, the lane and the fast path's aligned rows multiply each row-parallel
    weight leaf by leaf and each column-parallel one block by block (the lm_head in every
    mode): the start-up alignment probe must see those shapes too (unprobed,
    cuBLAS may give a leaf other bits at the fast path's row counts than at the lane's; on
    GPUs the invariant lane recomputed 35-73 % of the decoded tokens at TP 1 and 2, none at
    TP=4, where a leaf is a rank's whole weight). The lm_head's block stays last; biases
    line up."""
    spec = tiny_model()
    model, _, _ = load_model(spec, dtype="float32")
    plain = [tuple(w.shape) for w in model.gemm_weights()]
    local = shard_model(model, TPLayout(model.config, 1, 0), None, tree=True)
    shapes = [tuple(w.shape) for w in local.gemm_weights()]
    c = model.config
    o_leaf, down_leaf = (c.hidden_size, c.q_size // 4), (c.hidden_size, c.intermediate_size // 4)
    q_block, kv_head = (c.q_size // 4, c.hidden_size), (c.head_dim, c.hidden_size)
    mlp_block, vocab_block = (c.intermediate_size // 2, c.hidden_size), (c.vocab_size // 4,
                                                                          c.hidden_size)
    assert shapes[:4] == plain[:4] and shapes[-1] == vocab_block
    # (a block of the layer's own shape is probed once: the gate/up block is o_proj's here)
    assert set(shapes[4:-1]) == {o_leaf, down_leaf, q_block, kv_head, mlp_block} - set(plain)
    assert len(local.gemm_biases()) == len(shapes)
    # sharded again (engines sharing one loaded model): its rows stay in the tree's order
    # and its products read them; no shard can be cut from it
    ordered = local.logits(local(torch.tensor([3, 5, 7]), torch.arange(3),
                                 lambda i, q, k, v: q, TorchOps(), tp_reduce="ordered"),
                           TorchOps())
    again = shard_model(model, TPLayout(model.config, 1, 0), None, tree=False)
    assert again.tree_rows and torch.equal(
        again.logits(again(torch.tensor([3, 5, 7]), torch.arange(3), lambda i, q, k, v: q,
                           TorchOps(), tp_reduce="ordered"), TorchOps()), ordered)
    with pytest.raises(ValueError, match="no shard can be cut"):
        shard_model(model, TPLayout(model.config, 2, 0),
                    Group("gloo", 0, 2, None, 1.0, torch.device("cpu")), tree=True)
    fresh, _, _ = load_model(spec, dtype="float32")
    untreed = shard_model(fresh, TPLayout(model.config, 1, 0), None, tree=False)
    assert [tuple(w.shape) for w in untreed.gemm_weights()] == plain


def test_a_tree_twin_leaves_the_model_as_it_is() -> None:
    """A verifier serves the ordinary lane and the invariant one from one load: the tree's
    model is a twin whose reordered qkv and gate/up rows are its own (only those the tree
    reorders), and which shares the other weights; the model keeps its weights (same storage, same values) and its
    outputs, and the twin gives the same logits."""
    model, _, _ = load_model(tiny_model(**KV_BY_LEAF), dtype="float32")
    layer = model.layer_list[0]
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    ids, pos = torch.tensor([3, 5, 7, 11]), torch.arange(4)

    def logits(m: LlamaModel, reduce: RowReduce = "ordered") -> torch.Tensor:
        return m.logits(m(ids, pos, lambda i, q, k, v: q, TorchOps(), tp_reduce=reduce),
                        TorchOps())

    plain = logits(model)
    twin = shard_model(tree_twin(model), TPLayout(model.config, 1, 0), None, tree=True)
    assert model.parallel is None and not model.tree_rows and twin.tree_rows
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n
    assert twin.layer_list[0].o_proj is layer.o_proj  # (shared)
    assert twin.layer_list[0].qkv_proj.data_ptr() != layer.qkv_proj.data_ptr()
    assert not torch.equal(twin.layer_list[0].qkv_proj, layer.qkv_proj)  # (reordered)
    assert torch.equal(logits(model), plain)
    torch.testing.assert_close(logits(twin, "tree"), plain, rtol=1e-5, atol=1e-5)
    # K/V heads read by two leaves: the tree keeps qkv as it is, so the twin shares it
    straddling, _, _ = load_model(tiny_model(), dtype="float32")
    first = tree_twin(straddling).layer_list[0]
    assert first.qkv_proj is straddling.layer_list[0].qkv_proj
    assert first.gate_up_proj is not straddling.layer_list[0].gate_up_proj


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("size", [2, 4])
def test_tree_columns_come_from_calls_of_one_shape(size: int, kv_heads: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the tree, every output column of qkv, gate/up and the lm_head comes from a
    call of the same shape at TP=1 and at ``size``: with a GEMM whose bits depend on the
    call's width (as cuBLAS's choice of algorithm may), each rank's columns equal TP=1's
    bit for bit, in their natural order, with K/V heads by leaf (4) and alone (2, read by
    two leaves). Control: without the tree's blocks ("ordered"), they do not."""
    import torch.nn.functional as F

    real = F.linear

    def by_width(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return real(x, w, b) + (w.shape[0] % 97) * 1e-3  # "another algorithm" per width

    spec = tiny_model(hidden_size=128, num_heads=8, num_kv_heads=kv_heads)
    model, _, _ = load_model(spec, dtype="float32")
    c, d = model.config, model.config.head_dim
    whole = shard_model(model, TPLayout(c, 1, 0), None, tree=True)
    x = torch.randn(5, c.hidden_size, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(F, "linear", by_width)

    def columns(m: LlamaModel, reduce: RowReduce) -> list[torch.Tensor]:
        layer, tp = m.layer_list[0], m.parallel
        assert tp is not None
        return [tp.column_linear(TorchOps(), x, w, None, reduce)
                for w in (layer.qkv_proj, layer.gate_up_proj, m.lm_head_weight)]

    def shard(layout: TPLayout, group: Group) -> LlamaModel:
        with monkeypatch.context() as m:  # (loaded with the true product)
            m.setattr(F, "linear", real)
            fresh, _, _ = load_model(spec, dtype="float32")
        return shard_model(fresh, layout, group, tree=True)

    for reduce, same in (("tree", True), ("ordered", False)):
        qkv1, gu1, lm1 = columns(whole, reduce)
        agree = []
        for rank in range(size):
            layout = TPLayout(c, size, rank)
            group = Group("gloo", rank, size, None, 1.0, torch.device("cpu"))
            qkv, gu, lm = columns(shard(layout, group), reduce)
            (h0, h1), (lo, hi), (v0, v1) = layout.heads, layout.mlp, layout.vocab
            kv = [c.q_size + h * d for h in layout.kv_heads]
            k1 = torch.cat([qkv1[:, a:a + d] for a in kv], -1)
            v1_ = torch.cat([qkv1[:, a + c.kv_size:a + c.kv_size + d] for a in kv], -1)
            n = c.intermediate_size
            agree += [torch.equal(qkv, torch.cat([qkv1[:, h0 * d:h1 * d], k1, v1_], -1)),
                      torch.equal(gu, torch.cat([gu1[:, lo:hi], gu1[:, n + lo:n + hi]], -1)),
                      torch.equal(lm, lm1[:, v0:v1])]
        assert all(agree) if same else not any(agree), reduce


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("size", [1, 2])
def test_qkv_blocks_are_probed_with_their_part_of_the_bias(size: int, kv_heads: int) -> None:
    """A model with q/k/v biases (Qwen2's) under the tree: the alignment probe's qkv
    blocks carry the rows of the qkv bias their product adds (a bias can change cuBLAS's
    algorithm), ``layout.tree_shapes`` names exactly the biased blocks, and the product
    (its rows and bias kept in the tree's order where K/V heads go by leaf) gives the
    natural one's outputs, in the tree's blocks and in one call."""
    spec = tiny_model(attention_bias=True, hidden_size=128, num_heads=8, num_kv_heads=kv_heads)
    model, _, _ = load_model(spec, dtype="float32")
    group = Group("gloo", 0, size, None, 1.0, torch.device("cpu")) if size > 1 else None
    natural = (model.layer_list[0].qkv_proj.detach().clone(),
               cast(torch.Tensor, model.layer_list[0].qkv_bias).detach().clone())
    local = shard_model(model, TPLayout(model.config, size, 0), group, tree=True)
    qkv, bias = local.layer_list[0].qkv_proj, local.layer_list[0].qkv_bias
    assert bias is not None and local.parallel is not None
    k = qkv.shape[1]
    biased = []
    for w, b in zip(local.gemm_weights(), local.gemm_biases(), strict=True):
        if b is None:
            continue
        first = (w.data_ptr() - qkv.data_ptr()) // (k * qkv.element_size())
        assert torch.equal(b, bias[first:first + w.shape[0]])
        biased.append(tuple(w.shape))
    # qkv, then its blocks' shapes (a query block and a K/V head, or a leaf's q, k and v)
    assert biased[0] == tuple(qkv.shape) and len(biased) == (3 if kv_heads == 2 else 2)
    assert set(biased[1:]) == set(tree_shapes(model.config)[1])
    if size == 1:
        x = torch.randn(3, k)
        want = TorchOps().linear(x, *natural)
        for reduce in ("tree", "ordered"):
            got = local.parallel.column_linear(TorchOps(), x, qkv, bias, reduce)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _Recording(TorchOps):
    """Torch's products, each weight's shape noted."""

    def __init__(self) -> None:
        self.shapes: set[tuple[int, ...]] = set()

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        self.shapes.add(tuple(weight.shape))
        return super().linear(x, weight, bias)


@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (8, 4)])
def test_tree_shapes_are_the_trees_products_at_every_tp_size(heads: tuple[int, int]) -> None:
    """``layout.tree_shapes``, which the TP-invariant lane's shared chunk is probed on:
    exactly the products a TP=1 forward and its logits run under the tree (every call
    noted), and each rank's tree products at TP 2 and 4 (its ``gemm_weights`` past the
    layer's own) are among them; for even heads, for SmolLM2's 9 heads in 3 groups, and
    for K/V heads by leaf."""
    h, kv = heads
    spec = tiny_model(hidden_size=16 * h, num_heads=h, num_kv_heads=kv)
    model, _, _ = load_model(spec, dtype="float32")
    c = model.config
    whole = shard_model(model, TPLayout(c, 1, 0), None, tree=True)
    ops = _Recording()
    ids, positions = torch.tensor([3, 5, 7]), torch.arange(3)
    whole.logits(whole(ids, positions, lambda i, q, k, v: q, ops, tp_reduce="tree"), ops)
    shapes, _ = tree_shapes(c)
    assert ops.shapes == set(shapes)
    for size in (2, 4):
        for rank in range(size):
            group = Group("gloo", rank, size, None, 1.0, torch.device("cpu"))
            fresh, _, _ = load_model(spec, dtype="float32")
            local = shard_model(fresh, TPLayout(c, size, rank), group, tree=True)
            assert {tuple(w.shape) for w in local.gemm_weights()[4:]} <= set(shapes)


def test_tree_shapes_of_the_70b_shape() -> None:
    """The 70B shape's tree products, the same at TP 1, 2 and 4, each a TP=4 rank's whole
    product: o and down leaves 8,192 x 2,048 and 8,192 x 7,168, qkv blocks of 2,560 rows
    (16 query heads and their 2 K/V heads), gate/up blocks of 14,336, vocabulary blocks of
    32,064; the qkv blocks add a qkv bias where a model has one. The model is too large to
    load here: the shapes come from its config."""
    from detserve.model.random_init import shape_config

    shapes, biased = tree_shapes(shape_config("llama3-70b"))
    assert set(shapes) == {(8192, 2048), (8192, 7168), (2560, 8192), (14336, 8192),
                           (32064, 8192)}
    assert set(biased) == {(2560, 8192)}


# ---- engines at TP=1 and TP=2 -------------------------------------------------------

STATS: dict[str, float] = {}  # the last ``_run``'s engine statistics


def _run(model: str, params: SamplingParams, prompts: list[list[int]], mode: str,
         **kw: object) -> tuple[list[RequestOutput], dict[str, object]]:
    llm = LLM(model, mode, **LANE, **kw)  # type: ignore[arg-type]
    try:
        out = llm.generate(as_tokens(prompts), params)
        STATS.clear()
        STATS.update(llm.stats())
        return out, llm.determinism_profile()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # the last two share a 32-token prefix (two blocks the prefix cache may share)
    shared = random_prompts(2, [5, 9], seed=6, prefix=random_prompts(1, [32], seed=7)[0])
    return random_prompts(2, [6, 19], seed=5) + shared


def test_tp2_logits_match_tp1(model: str, prompts: list[list[int]]) -> None:
    """The ordinary (nondeterministic) mode: TP=2 computes the same function, its sums in
    another order; every prompt position's logprobs agree within float32 noise."""
    params = SamplingParams(max_tokens=8, prompt_logprobs=5, logprobs=5, ignore_eos=True)
    one, _ = _run(model, params, prompts, "nondeterministic")
    # (asynchronous scheduling: the workers get the tokens fed to the next step from rank 0)
    two, prof = _run(model, params, prompts, "nondeterministic", tensor_parallel_size=2,
                     async_scheduling=True)
    assert prof["tp_size"] == 2
    for a, b in zip(one, two, strict=True):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert pa is not None and pb is not None and pa.token_id == pb.token_id
            assert abs(pa.logprob - pb.logprob) < 1e-4
            assert pa.top.keys() == pb.top.keys()
            assert all(abs(pa.top[t] - pb.top[t]) < 1e-4 for t in pa.top)
        assert a.token_ids == b.token_ids
        assert all(abs(x.logprob - y.logprob) < 1e-4
                   for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True))


def _deterministic() -> SamplingParams:
    return SamplingParams(max_tokens=16, is_deterministic=True, temperature=0.8, seed=7,
                          logprobs=0, ignore_eos=True)


@pytest.mark.parametrize(("shape", "threaded"), [("llama", False), ("smollm2-heads", False),
                                               ("kv-by-leaf", False), ("llama", True)])
def test_invariant_lane_tp2_dvr_equals_tp1_lane_only(shape: str, threaded: bool,
                                                     prompts: list[list[int]]) -> None:
    """With the TP-invariant lane, llm42 at TP=2 (fast path perturbed: the lane must catch
    and replace every bad token) gives the TP=1 lane_only oracle's tokens and logprobs
    bit for bit, and the same fingerprint as llm42 at TP=1; also with the lane on threads
    of its own (rank 0's verifier thread and each worker's lane thread, in the lane's
    group) while the fast path keeps stepping, with asynchronous scheduling."""
    model = tiny_model(**{"llama": {}, "smollm2-heads": SMOLLM2_HEADS,
                          "kv-by-leaf": KV_BY_LEAF}[shape])
    params = _deterministic()
    oracle, _ = _run(model, params, prompts, "lane_only", tp_invariant_lane=True)
    _, prof_one = _run(model, params, prompts[:1], "llm42", tp_invariant_lane=True)
    dvr, prof_two = _run(model, params, prompts, "llm42", tp_invariant_lane=True,
                         tensor_parallel_size=2, fastpath_perturbation=0.2,
                         lane_threaded=threaded, async_scheduling=threaded)
    assert STATS["rollbacks"] > 0  # the lane did replace perturbed tokens
    assert [signature(o) for o in dvr] == [signature(o) for o in oracle]
    assert prof_two["fingerprint"] == prof_one["fingerprint"]
    assert "tp_invariant_lane" in prof_two and prof_two["tp_size"] == 2


@pytest.mark.parametrize("shape", ["llama", "kv-by-leaf"])
def test_invariant_lane_at_tp4(shape: str, prompts: list[list[int]]) -> None:
    """TP=4 (one query head and a replicated K/V head a rank; or two query heads and their
    K/V head): the lane's tree gives the TP=1 oracle's bits too."""
    model = tiny_model(**KV_BY_LEAF) if shape == "kv-by-leaf" else tiny_model()
    params = SamplingParams(max_tokens=6, is_deterministic=True, temperature=0.8, seed=3,
                            logprobs=0, ignore_eos=True)
    one, _ = _run(model, params, prompts[:2], "lane_only", tp_invariant_lane=True)
    four, _ = _run(model, params, prompts[:2], "lane_only", tp_invariant_lane=True,
                   tensor_parallel_size=4)
    assert [signature(o) for o in four] == [signature(o) for o in one]


def test_ordinary_lane_bits_depend_on_tp_size(model: str, prompts: list[list[int]]) -> None:
    """The negative control: without the invariant lane, TP=2's all-reduce sums o_proj and
    down_proj in another order than TP=1's single product, so the lane's logprob bits
    differ (the tokens, here, do not), and so do the fingerprints."""
    params = _deterministic()
    one, prof_one = _run(model, params, prompts, "lane_only")
    two, prof_two = _run(model, params, prompts, "lane_only", tensor_parallel_size=2)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    assert [signature(o) for o in one] != [signature(o) for o in two]
    assert prof_one["fingerprint"] != prof_two["fingerprint"]
    assert (prof_one["tp_size"], prof_two["tp_size"]) == (1, 2)


# ---- a lost worker ------------------------------------------------------------------

@pytest.mark.parametrize(("how", "threaded"), [(signal.SIGKILL, False),
                                               (signal.SIGSTOP, False),
                                               (signal.SIGKILL, True)],
                         ids=["killed", "stopped", "killed-lane-threaded"])
def test_lost_worker_fails_the_engine_within_the_deadline(model: str, how: signal.Signals,
                                                           threaded: bool,
                                                           prompts: list[list[int]]) -> None:
    """A worker killed (its sockets close) or stopped (it never answers) mid-generation:
    the next step raises TensorParallelError within tp_timeout_s, never hangs; the engine
    stays failed and closes (also with the lane on threads of its own)."""
    deadline = 3.0
    llm = LLM(model, "llm42", **LANE, tensor_parallel_size=2,  # type: ignore[arg-type]
              tp_timeout_s=deadline, lane_threaded=threaded)
    engine = llm.engine
    workers = engine._workers
    assert workers is not None
    procs = list(workers.procs)
    try:
        # (deterministic with the threaded lane: its passes run while the worker goes)
        engine.add_request("a", None, SamplingParams(max_tokens=64, ignore_eos=True,
                                                     is_deterministic=threaded),
                           prompt_token_ids=prompts[0])
        for _ in range(3):
            engine.step()
        os.kill(procs[0].pid, how)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="lost"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - t0 < deadline + 5.0
        with pytest.raises(TensorParallelError, match="already failed"):
            engine.step()
    finally:
        engine.close()
    assert procs and not any(p.is_alive() for p in procs)


# ---- the real SmolLM2 -----------------------------------------------------------------

@pytest.mark.slow
def test_real_smollm2_at_tp2_answers_with_the_tp1_lane_bits() -> None:
    """SmolLM2-135M (9 query heads, 3 K/V heads) at TP=2: rank 0 holds 4 K/V heads (head 0
    three times, head 1 once), the answer has TP=1's lane bits (llm42 at both: every
    committed token is the lane's; fewer lane passes than lane_only)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=7, is_deterministic=True, logprobs=0)
    outs = {}
    for tp in (1, 2):
        llm = LLM("smollm2", "llm42", max_model_len=128, verify_window=8, verify_group=4,
                  tp_invariant_lane=True, tensor_parallel_size=tp)
        try:
            outs[tp] = llm.chat(msgs, params)[0]
            assert llm.engine.pool.data.shape[4] == (3 if tp == 1 else 4)
        finally:
            llm.close()
    assert "Paris" in outs[2].text
    assert signature(outs[2]) == signature(outs[1])


@pytest.mark.parametrize(("tp", "invariant", "aligned"), [
    (1, False, "all_reduce"), (2, False, "all_reduce"), (4, False, "ordered"),
    (1, True, "tree"), (2, True, "tree"), (4, True, "tree")])
def test_aligned_fast_rows_sum_as_the_lane_does(tp: int, invariant: bool, aligned: str) -> None:
    """A fast forward whose decode rows the lane will verify sums the ranks' partials as
    the lane does wherever NCCL could add them in another order (at 4 ranks its ring is
    not the lane's pairwise tree: on 4 x H200, llm42 rolled windows back at TP=4 and none
    at TP=2); at 2 ranks both add the same two partials. Every other fast forward takes the all-reduce,
    and the lane and batch_invariant keep their fixed orders."""
    n = LaneNumerics(tensor_parallel_size=tp, tp_invariant_lane=invariant)
    assert n.row_reduce("fast", aligned=True) == aligned
    assert n.row_reduce("fast") == "all_reduce"
    assert n.row_reduce("lane") == ("tree" if invariant else "ordered")
    assert n.row_reduce("bi") == "ordered"
