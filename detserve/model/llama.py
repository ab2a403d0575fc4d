"""Llama-architecture decoder (Llama 3.x, SmolLM2, Mistral; optional Qwen2-style qkv bias).

The model does arithmetic only. How matrix products and norms reduce is delegated to an
``Ops`` object and how attention reads/writes the paged KV cache to an ``AttentionFn``, so
the same weights run on the fast path, in the fixed-shape lane and in batch-invariant mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol, cast

import torch
from torch import Tensor, nn

from detserve.model.config import ModelConfig


class Ops(Protocol):
    """Reduction-bearing primitives; implementations choose the reduction order."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...

    def add_rmsnorm(self, x: Tensor, delta: Tensor, weight: Tensor,
                    eps: float) -> tuple[Tensor, Tensor]:
        """The residual add before a norm: ``(x + delta, rmsnorm(x + delta))``."""
        ...

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """silu(first half) * second half, along the last dim."""
        ...


# (layer index, q [N, H, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, H, D].
# The callable writes k/v into the cache for the rows' positions before attending. With
# ``rope_in_attention`` the model hands it q and k before RoPE and it rotates them itself
# (a fused kernel must be bitwise equal to ``apply_rope``).
AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


# how a row-parallel product's partials are summed over the ranks (``Parallel.row_linear``)
RowReduce = Literal["all_reduce", "ordered", "tree"]


class Parallel(Protocol):
    """Where the model's tensor-parallel shards meet (``detserve.parallel``). A model without
    one holds whole weights and computes everything itself."""

    def embed(self, table: Tensor, ids: Tensor) -> Tensor:
        """Rows of the embedding for ``ids``, from this rank's vocabulary shard ``table``."""
        ...

    def row_linear(self, ops: Ops, x: Tensor, weight: Tensor, reduce: RowReduce) -> Tensor:
        """A row-parallel product (o_proj, down_proj): this rank's K shard of ``x`` times
        ``weight``'s, summed over the ranks; the same result on every rank. ``reduce``:
        "all_reduce" (the backend's algorithm, whose order may depend on the tensor's size:
        the fast path), "ordered" (partials gathered and summed in a fixed order: a row's
        bits never depend on the batch) or "tree" (a fixed binary tree over K leaves whose
        top levels are the TP split: the same bits at every TP size)."""
        ...

    def column_linear(self, ops: Ops, x: Tensor, weight: Tensor, bias: Tensor | None,
                      reduce: RowReduce) -> Tensor:
        """A column-parallel product (qkv; the lm_head with ``reduce`` "tree" always):
        this rank's output columns, in their natural order. "tree": in the column blocks a
        rank of the largest TP size the tree spans would hold (``layout.column_blocks``;
        vocabulary leaves), so that every output column comes from a call of the same shape
        at every TP size (cuBLAS picks its algorithm, split-K included, from the call's
        shape)."""
        ...

    def mlp(self, ops: Ops, x: Tensor, gate_up: Tensor, down: Tensor,
            reduce: RowReduce) -> Tensor:
        """The MLP: ``row_linear`` of ``ops.silu_mul`` of this rank's [gate | up] product;
        "tree": leaf by leaf of down_proj's K, each leaf's gate/up block, activation and
        down product in tensors of the same shapes at every TP size (a CPU exp's bits
        depend on an element's place in the vectorized loop)."""
        ...

    def vocab_logits(self, local: Tensor) -> Tensor:
        """The logits of every token from this rank's vocabulary shard's (all-gathered)."""
        ...

    def leaf_weights(self, weights: Sequence[Tensor],
                     biases: Sequence[Tensor | None]) -> list[tuple[Tensor, Tensor | None]]:
        """One weight of each product shape the "tree" runs for ``weights`` (the K leaves
        of row-parallel ones, the column blocks of column-parallel ones) that ``weights``
        do not already have, with the part of its weight's bias (``biases``) it adds."""
        ...

    def vocab_block(self, weight: Tensor) -> Tensor:
        """The lm_head ``weight`` as one logits call multiplies it (its first vocabulary
        block under the tree, else itself)."""
        ...


class WeightShard(Protocol):
    """The part of every weight a process holds (a tensor-parallel rank's:
    ``parallel.shard.RankWeights``)."""

    @property
    def vocab_rows(self) -> int: ...

    def local_config(self) -> ModelConfig: ...

    def weight(self, name: str, whole: Tensor) -> Tensor: ...


def rope_inv_freq(config: ModelConfig) -> Tensor:
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = config.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (Hugging Face layout). x: [N, heads, D]; cos/sin: [N, D/2] fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", vocab_rows: int | None = None) -> None:
        """``vocab_rows``: rows of the embedding and the lm_head held here (a tensor-parallel
        vocabulary shard; default the whole vocabulary). A sharded model's ``config`` has
        its rank's head and MLP counts (``parallel.layout.TPLayout.local_config``)."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.parallel: Parallel | None = None  # set by ``parallel.shard.shard_model``
        # its qkv and gate/up rows are kept in the TP-invariant tree's order (set there)
        self.tree_rows = False
        c = config
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        vocab = c.vocab_size if vocab_rows is None else vocab_rows
        self.embed_tokens = nn.Parameter(torch.empty(vocab, c.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(_Layer(c, kw) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size, **kw), requires_grad=False)
        self.lm_head = (
            None if c.tie_word_embeddings
            else nn.Parameter(torch.empty(vocab, c.hidden_size, **kw), requires_grad=False)
        )
        # cos/sin tables in fp32, indexed by absolute position: RoPE never depends on the batch.
        pos = torch.arange(c.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(pos, rope_inv_freq(c))
        self.register_buffer("rope_cos", freqs.cos().float().to(device), persistent=False)
        self.register_buffer("rope_sin", freqs.sin().float().to(device), persistent=False)

    @property
    def layer_list(self) -> list[_Layer]:
        return cast(list[_Layer], list(self.layers))

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionFn, ops: Ops,
                rope_in_attention: bool = False, tp_reduce: RowReduce = "all_reduce") -> Tensor:
        """Rows are independent tokens (flattened batch). Returns final-normed hidden [N, hidden].
        ``tp_reduce``: how row-parallel products sum over the ranks (``Parallel``)."""
        c = self.config
        tp = self.parallel
        h = self.embed_tokens[input_ids] if tp is None else tp.embed(self.embed_tokens, input_ids)

        def row_linear(x: Tensor, weight: Tensor) -> Tensor:
            return ops.linear(x, weight) if tp is None else tp.row_linear(ops, x, weight, tp_reduce)

        if not rope_in_attention:
            cos = cast(Tensor, self.rope_cos)[positions]
            sin = cast(Tensor, self.rope_sin)[positions]
        n = h.shape[0]
        layers = self.layer_list
        if not layers:
            return ops.rmsnorm(h, self.norm, c.rms_norm_eps)
        x = ops.rmsnorm(h, layers[0].input_norm, c.rms_norm_eps)
        for i, layer in enumerate(layers):
            qkv = (ops.linear(x, layer.qkv_proj, layer.qkv_bias) if tp is None
                   else tp.column_linear(ops, x, layer.qkv_proj, layer.qkv_bias, tp_reduce))
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.reshape(n, c.num_heads, c.head_dim)
            k = k.reshape(n, c.num_kv_heads, c.head_dim)
            if not rope_in_attention:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.reshape(n, c.num_kv_heads, c.head_dim)
            o = attention(i, q, k, v).reshape(n, c.q_size)
            h, x = ops.add_rmsnorm(h, row_linear(o, layer.o_proj), layer.post_norm,
                                   c.rms_norm_eps)
            mlp = (ops.linear(ops.silu_mul(ops.linear(x, layer.gate_up_proj)), layer.down_proj)
                   if tp is None
                   else tp.mlp(ops, x, layer.gate_up_proj, layer.down_proj, tp_reduce))
            # the next layer's input norm (the final norm after the last layer) on h + mlp
            norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
            h, x = ops.add_rmsnorm(h, mlp, norm, c.rms_norm_eps)
        return x

    def gemm_weights(self) -> list[Tensor]:
        """One weight of every matrix-product shape the forward uses, then the lm_head's:
        with the TP-invariant tree, also its leaves' and column blocks' (the lane and the
        fast path's aligned rows multiply those; the lm_head's last is its block)."""
        return [w for w, _ in self._gemm_products()]

    def gemm_biases(self) -> list[Tensor | None]:
        """The biases the forward adds to ``gemm_weights``' products (qkv's and its blocks',
        if any)."""
        return [b for _, b in self._gemm_products()]

    def _gemm_products(self) -> list[tuple[Tensor, Tensor | None]]:
        first = self.layer_list[0]
        layer = [first.qkv_proj, first.o_proj, first.gate_up_proj, first.down_proj]
        biases = [first.qkv_bias, None, None, None]
        tp = self.parallel
        if tp is None:
            return [*zip(layer, biases, strict=True), (self.lm_head_weight, None)]
        head = tp.vocab_block(self.lm_head_weight)
        leaves = [(w, b) for w, b in tp.leaf_weights([*layer, self.lm_head_weight],
                                                     [*biases, None])
                  if w.shape != head.shape]
        return [*zip(layer, biases, strict=True), *leaves, (head, None)]

    @torch.inference_mode()
    def logits(self, hidden: Tensor, ops: Ops) -> Tensor:
        tp = self.parallel
        if tp is None:
            return ops.linear(hidden, self.lm_head_weight).float()
        # in the tree's vocabulary blocks wherever the model has them (every mode: a few
        # calls instead of one, and the aligned rows' logits need no mode of their own)
        return tp.vocab_logits(tp.column_linear(ops, hidden, self.lm_head_weight, None,
                                                "tree").float())

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]],
                     shard: Callable[[str, Tensor], Tensor] | None = None) -> None:
        """Load Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...),
        each put in place as soon as its parameter is complete, so the host holds only the
        parts of a parameter still being read, never the checkpoint.

        q/k/v are fused into ``qkv_proj`` and gate/up into ``gate_up_proj``. ``shard(name,
        whole)``: the part of the whole model's parameter ``name`` this model holds (a
        tensor-parallel rank's), cut before it is copied to the device. Raises on unknown
        names and on weights left unset.
        """
        params = dict(self.named_parameters())
        plan = self._checkpoint_plan()
        partial: dict[str, dict[str, Tensor]] = {}
        done: set[str] = set()
        unexpected: list[str] = []
        embed: Tensor | None = None  # an untied lm_head's fallback source

        def put(param: str, src: Tensor, key: str) -> None:
            dst = params[param]
            if shard is not None:
                src = shard(param, src)
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"{key}: shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(src.to(dst.dtype))
            done.add(param)

        for name, t in weights:
            name = name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the lm_head
            if name not in plan:
                unexpected.append(name)
                continue
            if name == "embed_tokens.weight" and self.lm_head is not None:
                embed = t
            param, parts = plan[name]
            got = partial.setdefault(param, {})
            got[name] = t
            if len(got) == len(parts):
                del partial[param]
                put(param, got[parts[0]] if len(parts) == 1
                    else torch.cat([got[k] for k in parts], 0), name)
        if self.lm_head is not None and "lm_head" not in done and embed is not None:
            put("lm_head", embed, "embed_tokens.weight")
        if unexpected:
            raise ValueError(f"unexpected weights: {sorted(unexpected)[:5]}")
        missing = [k for k, (param, _) in plan.items()
                   if param not in done and k not in partial.get(param, {})]
        if missing:
            raise KeyError(f"missing weight {missing[0]}")

    def _checkpoint_plan(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """Each checkpoint name: the parameter it fills and that parameter's checkpoint
        parts, in fusion order."""
        plan: dict[str, tuple[str, tuple[str, ...]]] = {}

        def add(param: str, *parts: str) -> None:
            for k in parts:
                plan[k] = (param, parts)

        add("embed_tokens", "embed_tokens.weight")
        add("norm", "norm.weight")
        if self.lm_head is not None:
            add("lm_head", "lm_head.weight")
        for i, layer in enumerate(self.layer_list):
            p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            add(p + "qkv_proj", *(a + f"{x}_proj.weight" for x in "qkv"))
            if layer.qkv_bias is not None:
                add(p + "qkv_bias", *(a + f"{x}_proj.bias" for x in "qkv"))
            add(p + "o_proj", a + "o_proj.weight")
            add(p + "gate_up_proj", m + "gate_proj.weight", m + "up_proj.weight")
            add(p + "down_proj", m + "down_proj.weight")
            add(p + "input_norm", p + "input_layernorm.weight")
            add(p + "post_norm", p + "post_attention_layernorm.weight")
        return plan


class _Layer(nn.Module):
    def __init__(self, c: ModelConfig, kw: dict[str, Any]) -> None:
        super().__init__()
        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)
        self.qkv_proj = p(c.q_size + 2 * c.kv_size, c.hidden_size)
        self.qkv_bias = p(c.q_size + 2 * c.kv_size) if c.attention_bias else None
        self.o_proj = p(c.hidden_size, c.q_size)
        self.gate_up_proj = p(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = p(c.hidden_size, c.intermediate_size)
        self.input_norm = p(c.hidden_size)
        self.post_norm = p(c.hidden_size)
