"""A rank's shard of the Llama model, cut from the whole model at load time, and the
collectives that join the shards (``llama.Parallel``).

Column-parallel (each output column whole on one rank, so its K reduction does not depend on
the TP size): QKV, gate/up and the lm_head (vocabulary rows). Row-parallel (K split across
ranks, partials summed): o_proj and down_proj. Replicated: the norms and the residual
stream. The embedding is vocabulary-parallel: each rank looks up its rows and the owner's
row is gathered, so no sum touches it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from detserve.distributed import Group
from detserve.model.config import ModelConfig
from detserve.model.llama import LlamaModel, Ops, RowReduce
from detserve.model.loader import read_model_config
from detserve.parallel.layout import ColumnBlocks, TPLayout, column_blocks
from detserve.parallel.peer_sum import PeerSum

Ranges = Sequence[tuple[int, int]]  # leaves' K column ranges, relative to a rank's own


def tree_sum(parts: list[Tensor]) -> Tensor:
    """Pairwise sum in a fixed binary tree: (left half) + (right half), recursively."""
    if len(parts) == 1:
        return parts[0]
    mid = len(parts) // 2
    return tree_sum(parts[:mid]) + tree_sum(parts[mid:])


def _equal_widths(x: Tensor, ranges: Ranges, width: int) -> int:
    """The leaves' common width where they tile ``width`` in equal parts and ``x`` is
    contiguous (so a view can split it), else 0."""
    if not x.is_contiguous():
        return 0
    widths = {b - a for a, b in ranges}
    w = widths.pop() if len(widths) == 1 else 0
    return w if w * len(ranges) == width and ranges[0][0] == 0 else 0


def leaf_columns(x: Tensor, ranges: Ranges) -> list[Tensor]:
    """``x``'s K columns of each leaf (``ranges``, in tree order) as a contiguous [rows, b - a] tensor: one copy for
    all of them where the leaves are equal (the usual case), else one each. The products
    see the same shapes and strides either way, so the same bits."""
    n, k = x.shape
    w = _equal_widths(x, ranges, k)
    if not w:
        return [x[:, a:b].contiguous() for a, b in ranges]
    return list(x.view(n, len(ranges), w).transpose(0, 1).contiguous().unbind(0))


@dataclass(frozen=True)
class _Columns:
    """A column-parallel weight under the tree: its blocks' row ranges and weights (views of
    the weight as kept), and where each of its natural output rows sits in a product of the
    kept weight (None: in place)."""

    ranges: list[tuple[int, int]]
    weights: list[Tensor]
    restore: Tensor | None


class TensorParallel:
    """``llama.Parallel`` for one rank: its ``group`` (None at TP=1) and layout. With
    ``tree`` the row-parallel weights are also kept cut into the tree's leaves (contiguous
    copies, so that a leaf's product sees the same shapes and strides at every TP size),
    and the column-parallel ones in the tree's blocks (``layout.column_blocks``)."""

    def __init__(self, layout: TPLayout, group: Group | None,
                 device: torch.device | str = "cpu") -> None:
        if (group is None) != (layout.size == 1) or (group is not None and (
                group.size != layout.size or group.rank != layout.rank)):
            raise ValueError("the group must match the layout (none at TP=1)")
        self.layout, self._main = layout, group
        self._thread = threading.local()  # a thread's own group (``on``)
        starts = [a for a, _ in layout.vocab_ranges()]
        # on the model's device: a CUDA graph's capture copies nothing from the host
        self._vocab_starts = torch.tensor(starts[1:], dtype=torch.long, device=device)
        # id(weight) -> its leaves' K ranges and weights, in tree order
        self._leaves: dict[int, tuple[Ranges, list[Tensor]]] = {}
        # id(weight) -> its column blocks
        self._columns: dict[int, _Columns] = {}
        self._peer_sums: dict[int, PeerSum] = {}  # id(group) -> its peer-load sum

    @property
    def group(self) -> Group | None:
        """The group this thread's forwards meet in (None at TP=1)."""
        return getattr(self._thread, "group", None) or self._main

    @contextmanager
    def on(self, group: Group | None) -> Iterator[None]:
        """Meanwhile this thread's forwards meet in ``group`` (another of the same ranks):
        the lane's thread runs its passes in a group of its own, so that its collectives
        and the fast path's, each issued in one order on every rank, never interleave in
        one group."""
        if group is not None and (group.size, group.rank) != (self.layout.size,
                                                             self.layout.rank):
            raise ValueError("the group must match the layout")
        before = getattr(self._thread, "group", None)
        self._thread.group = group
        try:
            yield
        finally:
            self._thread.group = before

    def add_peer_sums(self, sums: list[PeerSum]) -> None:
        """Sum small row-parallel partials by peer loads in these sums' groups."""
        self._peer_sums.update({id(p.group): p for p in sums})

    def _peer_sum(self, y: Tensor, reduce: RowReduce) -> Tensor | None:
        """``y`` summed over the ranks by peer loads, or None (NCCL then): where the group
        has them, ``y`` fits, and the sum's order cannot matter (the fast path's plain
        all-reduce) or is every order's (two ranks: ``peer_sum``'s docstring)."""
        peer = self._peer_sums.get(id(self.group))
        if peer is None or (reduce != "all_reduce" and self.layout.size != 2):
            return None
        return peer(y)

    def add_leaves(self, weight: Tensor, ranges: Ranges) -> None:
        """Keep ``weight`` (a row-parallel product's, [N, K_local]) cut into the tree's
        leaves, K column ranges in tree order."""
        self._leaves[id(weight)] = (list(ranges), [weight[:, a:b].contiguous() for a, b in ranges])

    def add_columns(self, weight: Tensor, blocks: ColumnBlocks,
                    bias: Tensor | None = None, reorder: bool = True) -> None:
        """Run ``weight``'s (a column-parallel product's, [N_local, K]) "tree" products
        as ``blocks``' calls; where they keep its rows in another order, reorder the rows of
        ``weight`` and ``bias`` (in place) now, unless they are in it already
        (``reorder`` False)."""
        restore = blocks.restore()
        if blocks.order is not None and reorder:
            order = torch.tensor(blocks.order, device=weight.device)
            weight.data = weight.data.index_select(0, order)
            if bias is not None:
                bias.data = bias.data.index_select(0, order)
        self._columns[id(weight)] = _Columns(
            list(blocks.blocks), [weight[a:b] for a, b in blocks.blocks],
            None if restore is None else torch.tensor(restore, device=weight.device))

    # ---- llama.Parallel ----
    def column_linear(self, ops: Ops, x: Tensor, weight: Tensor, bias: Tensor | None,
                      reduce: RowReduce) -> Tensor:
        cols = self._columns.get(id(weight))
        if cols is None:
            return ops.linear(x, weight, bias)
        if reduce == "tree":
            parts = [ops.linear(x, w, None if bias is None else bias[a:b])
                     for (a, b), w in zip(cols.ranges, cols.weights, strict=True)]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        else:
            y = ops.linear(x, weight, bias)
        return y if cols.restore is None else y.index_select(-1, cols.restore)

    def vocab_block(self, weight: Tensor) -> Tensor:
        cols = self._columns.get(id(weight))
        return weight if cols is None else cols.weights[0]

    def embed(self, table: Tensor, ids: Tensor) -> Tensor:
        if self.group is None:
            return table[ids]
        v0, v1 = self.layout.vocab
        local = table[(ids - v0).clamp(0, v1 - v0 - 1)]  # right only for this rank's ids
        rows = self._gather(local)
        owner = torch.bucketize(ids, self._vocab_starts, right=True)
        return torch.stack(rows)[owner, torch.arange(ids.shape[0], device=ids.device)]

    def row_linear(self, ops: Ops, x: Tensor, weight: Tensor, reduce: RowReduce) -> Tensor:
        if reduce != "tree":
            y = ops.linear(x, weight).contiguous()
            if self.group is None:
                return y
            if (summed := self._peer_sum(y, reduce)) is not None:
                return summed
            if reduce == "ordered":
                return tree_sum(self._gather(y))
            self.group.follow(self.group.all_reduce(y))
            return y
        ranges, leaves = self._leaves_of(weight)
        return self._tree(reduce, [ops.linear(xs, w) for xs, w
                                   in zip(leaf_columns(x, ranges), leaves, strict=True)])

    def mlp(self, ops: Ops, x: Tensor, gate_up: Tensor, down: Tensor,
            reduce: RowReduce) -> Tensor:
        cols = self._columns.get(id(gate_up))
        if cols is None:
            return self.row_linear(ops, ops.silu_mul(ops.linear(x, gate_up)), down, reduce)
        if reduce != "tree":
            return self.row_linear(ops, _activation(ops, ops.linear(x, gate_up), cols),
                                   down, reduce)
        # leaf by leaf: its [gate | up] block, activation and down_proj leaf, each
        # activation multiplied before the next is computed (a padded product's buffer,
        # which the activation may write into, holds one leaf at a time)
        _, leaves = self._leaves_of(down)
        return self._tree(reduce, [ops.linear(ops.silu_mul(ops.linear(x, gu)), w) for gu, w
                                   in zip(cols.weights, leaves, strict=True)])

    def _leaves_of(self, weight: Tensor) -> tuple[Ranges, list[Tensor]]:
        leaves = self._leaves.get(id(weight))
        if leaves is None:
            raise RuntimeError("the TP-invariant tree was asked for a weight without leaves "
                               "(tp_invariant_lane off at load?)")
        return leaves

    def _tree(self, reduce: RowReduce, products: list[Tensor]) -> Tensor:
        """This rank's leaf ``products`` summed in the tree, then over the ranks in its top
        levels."""
        local = tree_sum(products)
        if self.group is None:
            return local
        if (summed := self._peer_sum(local, reduce)) is not None:
            return summed
        return tree_sum(self._gather(local.contiguous()))

    def leaf_weights(self, weights: Sequence[Tensor],
                     biases: Sequence[Tensor | None]) -> list[tuple[Tensor, Tensor | None]]:
        shapes = {tuple(w.shape) for w in weights}
        out: list[tuple[Tensor, Tensor | None]] = []
        for w, bias in zip(weights, biases, strict=True):
            cols = self._columns.get(id(w), _Columns([], [], None))
            parts = [*((leaf, None) for leaf in self._leaves.get(id(w), ((), []))[1]),
                     *((blk, None if bias is None else bias[a:b])
                       for (a, b), blk in zip(cols.ranges, cols.weights, strict=True))]
            for leaf, part in parts:
                if tuple(leaf.shape) not in shapes:
                    shapes.add(tuple(leaf.shape))
                    out.append((leaf, part))
        return out

    def vocab_logits(self, local: Tensor) -> Tensor:
        if self.group is None:
            return local
        sizes = [b - a for a, b in self.layout.vocab_ranges()]
        width = max(sizes)
        padded = torch.nn.functional.pad(local, (0, width - local.shape[-1])).contiguous()
        parts = self._gather(padded)
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    def _gather(self, t: Tensor) -> list[Tensor]:
        """``t`` of every rank, in rank order."""
        assert self.group is not None
        out = [torch.empty_like(t) for _ in range(self.layout.size)]
        self.group.follow(self.group.all_gather(out, t))
        return out


def _activation(ops: Ops, gate_up: Tensor, cols: _Columns) -> Tensor:
    """The activation of a product of gate/up as the tree keeps it (each leaf's gate then up
    rows), in the MLP's column order: one call over the leaves as rows where they are
    equal, else one a leaf."""
    n, k = gate_up.shape
    w = _equal_widths(gate_up, cols.ranges, k)
    if w:
        return ops.silu_mul(gate_up.view(n * len(cols.ranges), w)).view(n, -1)
    return torch.cat([ops.silu_mul(gate_up[:, a:b].contiguous()) for a, b in cols.ranges],
                     dim=-1)


class RankWeights:
    """The part of every weight one rank holds (``model.loader.WeightShard``): handed to
    ``load_model`` so that a rank reads the checkpoint and keeps, on its device, only its
    shard. The whole model never exists there, so a model larger than one device loads."""

    def __init__(self, layout: TPLayout) -> None:
        self.layout = layout
        c, d = layout.config, layout.config.head_dim
        first, end = layout.heads
        kv = [torch.arange(h * d, (h + 1) * d) for h in layout.kv_heads]
        kv_rows = torch.cat(kv)
        self._qkv_rows = torch.cat([torch.arange(first * d, end * d), c.q_size + kv_rows,
                                    c.q_size + c.kv_size + kv_rows])

    def local_config(self) -> ModelConfig:
        return self.layout.local_config()

    @property
    def vocab_rows(self) -> int:
        v0, v1 = self.layout.vocab
        return v1 - v0

    def weight(self, name: str, whole: Tensor) -> Tensor:
        """This rank's part of the whole model's parameter ``name`` (``LlamaModel``'s
        names: ``embed_tokens``, ``layers.3.qkv_proj`` ...), on ``whole``'s device."""
        layout = self.layout
        if layout.size == 1:
            return whole
        kind = name.rsplit(".", 1)[-1]
        d, inter = layout.config.head_dim, layout.config.intermediate_size
        first, end = layout.heads
        lo, hi = layout.mlp
        if kind in ("embed_tokens", "lm_head"):
            v0, v1 = layout.vocab
            return whole[v0:v1]
        if kind in ("qkv_proj", "qkv_bias"):
            return whole.index_select(0, self._qkv_rows.to(whole.device))
        if kind == "o_proj":
            return whole[:, first * d:end * d]
        if kind == "gate_up_proj":
            return torch.cat([whole[lo:hi], whole[inter + lo:inter + hi]])
        if kind == "down_proj":
            return whole[:, lo:hi]
        if kind.endswith("norm"):  # replicated
            return whole
        raise KeyError(f"no tensor-parallel rule for parameter {name!r}")


def rank_weights(spec: str, size: int, rank: int = 0) -> RankWeights | None:
    """What ``load_model(spec, shard=)`` keeps for ``rank`` of ``size`` (None at TP=1:
    everything)."""
    if size == 1:
        return None
    return RankWeights(TPLayout(read_model_config(spec), size, rank))


@torch.inference_mode()
def shard_model(model: LlamaModel, layout: TPLayout, group: Group | None,
                tree: bool, peer_sums: Sequence[PeerSum] = ()) -> LlamaModel:
    """This rank's shard of ``model``, joined by a ``TensorParallel`` over ``group``.
    ``model``: the whole model (left unchanged; the shard is cut from it) or already this
    rank's shard (``load_model(shard=RankWeights(layout))``, used as is). ``tree``: ready
    for the TP-invariant lane; ``peer_sums``: the groups' small sums by peer loads
    (``PeerSum``)."""
    rank = RankWeights(layout)
    if model.tree_rows and model.config == layout.config and layout.size > 1:
        raise ValueError("the model's rows are in the TP-invariant tree's order (it was "
                         "sharded at TP=1 with the tree): no shard can be cut from it")
    if model.config == layout.config:
        local = model if layout.size == 1 else cut_shard(model, rank)
    elif (model.config == layout.local_config()
          and model.embed_tokens.shape[0] == rank.vocab_rows):
        local = model
    else:
        raise ValueError("the layout is another model's")
    c = layout.config
    d = c.head_dim
    parallel = TensorParallel(layout, group, local.embed_tokens.device)
    parallel.add_peer_sums(list(peer_sums))
    # (a model sharded again, as engines that share one loaded model do at TP=1: rows kept
    # in the tree's order stay so, and its products still need the blocks to read them)
    kept = local.tree_rows
    if tree or kept:
        qkv, gate_up = column_blocks(layout)
        for layer in local.layer_list:
            parallel.add_columns(layer.qkv_proj, qkv, layer.qkv_bias, reorder=not kept)
            parallel.add_columns(layer.gate_up_proj, gate_up, reorder=not kept)
        parallel.add_columns(local.lm_head_weight,
                             ColumnBlocks(None, tuple(layout.leaves(c.vocab_size))))
        local.tree_rows = True
    if tree:
        heads = [(a * d, b * d) for a, b in layout.leaves(c.num_heads)]
        columns = layout.leaves(c.intermediate_size)
        for layer in local.layer_list:
            parallel.add_leaves(layer.o_proj, heads)
            parallel.add_leaves(layer.down_proj, columns)
    local.parallel = parallel
    return local


def tree_twin(model: LlamaModel) -> LlamaModel:
    """A model that shares ``model``'s parameters but for its qkv (and bias) and gate/up
    weights, copies of its own: ``shard_model``'s tree may reorder those rows while
    ``model`` serves on unchanged (a verifier serving the ordinary lane and the invariant
    one from one load; reordered in place, ``model``'s captured CUDA graphs would read
    freed weights). Costs a copy of the weights the tree reorders (gate/up always, qkv
    where its K/V heads go by leaf)."""
    qkv, gate_up = column_blocks(TPLayout(model.config, 1, 0))
    own = set() if model.tree_rows else {
        *(("qkv_proj", "qkv_bias") if qkv.order is not None else ()),
        *(("gate_up_proj",) if gate_up.order is not None else ())}
    twin = LlamaModel(model.config, dtype=model.dtype, device="meta",
                      vocab_rows=model.embed_tokens.shape[0])
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        target = twin.get_submodule(path) if path else twin
        setattr(target, leaf, torch.nn.Parameter(p.detach().clone(), requires_grad=False)
                if leaf in own else p)
    twin.rope_cos, twin.rope_sin = model.rope_cos, model.rope_sin
    twin.tree_rows = model.tree_rows
    return twin.eval()


def cut_shard(model: LlamaModel, rank: RankWeights) -> LlamaModel:
    """``rank``'s shard of the whole ``model``, on its device."""
    local = LlamaModel(rank.local_config(), dtype=model.dtype, device=model.embed_tokens.device,
                       vocab_rows=rank.vocab_rows)
    whole = dict(model.named_parameters())
    for name, p in local.named_parameters():
        p.copy_(rank.weight(name, whole[name]))
    return local.eval()
