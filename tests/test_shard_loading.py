"""Loading a tensor-parallel rank's shard (issue 36): a rank reads the checkpoint tensor by
tensor and keeps only its part, so no device ever holds the whole model, and the shard is
the very one cut from the whole model (HF folders, GGUF files, random shapes, biases, tied
and untied embeddings, SmolLM2's replicated K/V heads)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from model_helpers import make_random_llama, write_llama_gguf

from detserve.model.loader import load_model, read_model_config
from detserve.model.random_init import random_model
from detserve.parallel.layout import TPLayout
from detserve.parallel.shard import RankWeights, cut_shard, shard_model

SMOLLM2_HEADS = {"hidden_size": 144, "num_heads": 9, "num_kv_heads": 3,
                 "intermediate_size": 96, "vocab_size": 515}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def _assert_is_the_cut(spec: str, tp: int) -> None:
    """Every rank's loaded shard equals the one cut from the whole model, bit for bit, and
    together the ranks hold the whole model's parameters once (plus replicated norms)."""
    whole, _, info = load_model(spec)
    config = read_model_config(spec)
    for rank in range(tp):
        layout = TPLayout(config, tp, rank)
        mine, _, mine_info = load_model(spec, shard=RankWeights(layout))
        assert mine_info == info  # the identity is the whole model's
        assert mine.config == layout.local_config()
        want = _params(cut_shard(whole, RankWeights(layout)))
        got = _params(mine)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kw", [{}, {"tie_word_embeddings": True}, {"attention_bias": True}],
                         ids=["untied", "tied", "qkv-bias"])
def test_hf_shard_is_the_cut_of_the_whole_model(tp: int, kw: dict[str, bool]) -> None:
    _assert_is_the_cut(str(make_random_llama(**kw)), tp)  # type: ignore[arg-type]


def test_replicated_kv_heads_load_as_cut() -> None:
    """SmolLM2's heads at TP=2: rank 0 repeats K/V head 0 (its query heads straddle it)."""
    spec = str(make_random_llama(**SMOLLM2_HEADS))  # type: ignore[arg-type]
    _assert_is_the_cut(spec, 2)
    layout = TPLayout(read_model_config(spec), 2, 0)
    assert layout.kv_heads == (0, 0, 0, 1)


def test_gguf_shard_is_the_cut(tmp_path: pytest.TempPathFactory) -> None:
    gguf = write_llama_gguf(make_random_llama(), tmp_path / "m.gguf")  # type: ignore[operator]
    _assert_is_the_cut(str(gguf), 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_random_shard_draws_the_same_weights(tp: int) -> None:
    """A random shape's shard: each whole weight drawn in the same order from the same
    seed, then cut, so the ranks together hold exactly the TP=1 model."""
    _assert_is_the_cut("random:tiny", tp)
    whole, _, _ = random_model("tiny", torch.float32, "cpu")
    again, _, _ = random_model("tiny", torch.float32, "cpu")
    for (name, a), b in zip(_params(whole).items(), _params(again).values(), strict=True):
        assert torch.equal(a, b), name


def test_a_shard_holds_its_share_of_the_bytes() -> None:
    config = read_model_config("random:tiny")
    whole = sum(p.numel() for p in random_model("tiny", torch.float32, "cpu")[0].parameters())
    norms = config.hidden_size * (2 * config.num_layers + 1)
    per_kv_head = 2 * config.head_dim * config.hidden_size * config.num_layers  # K and V
    for tp in (2, 4):
        layouts = [TPLayout(config, tp, r) for r in range(tp)]
        held = [sum(p.numel() for p in load_model(
            "random:tiny", shard=RankWeights(layout))[0].parameters()) for layout in layouts]
        # replicated: the norms, and K/V heads shared by ranks (at TP=4 each of the 2)
        repeats = sum(len(layout.kv_heads) for layout in layouts) - config.num_kv_heads
        assert repeats == (0 if tp == 2 else 2)
        assert sum(held) == whole + (tp - 1) * norms + repeats * per_kv_head


def test_loading_streams_the_checkpoint() -> None:
    """Each tensor is put in place once its parameter is complete: while the checkpoint is
    read, the host holds the parts of the parameter being filled (q/k/v: up to three, the
    last until the next tensor arrives), never the tensors put before: a bound that does
    not grow with the checkpoint."""
    spec = make_random_llama(tie_word_embeddings=True)
    from detserve.model.hf_loader import iter_hf_weights

    alive: list[weakref.ref[torch.Tensor]] = []
    most = 0

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal most
        for name, t in iter_hf_weights(spec):
            gc.collect()
            most = max(most, sum(r() is not None for r in alive))
            alive.append(weakref.ref(t))
            yield name, t
            del t

    model, _, _ = load_model(str(spec))
    fresh = type(model)(model.config)
    fresh.load_weights(tracked())
    assert len(alive) == 20  # 2 layers of 9, the embedding and the final norm
    assert 1 <= most <= 3
    for (name, a), b in zip(_params(model).items(), _params(fresh).values(), strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_errors_are_named() -> None:
    """A missing part, an unknown name, and a wrong shape are refused with the name."""
    model, _, _ = load_model(str(make_random_llama()))
    from detserve.model.hf_loader import iter_hf_weights

    weights = dict(iter_hf_weights(make_random_llama()))
    fresh = type(model)(model.config)
    with pytest.raises(KeyError, match="missing weight layers.1.self_attn.k_proj.weight"):
        fresh.load_weights((k, v) for k, v in weights.items()
                           if k != "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="unexpected weights: \\['layers.0.mlp.extra'\\]"):
        fresh.load_weights([*weights.items(), ("model.layers.0.mlp.extra", torch.zeros(1))])
    bad = {**weights, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="norm.weight: shape"):
        fresh.load_weights(bad.items())


def test_a_shard_of_another_model_is_refused() -> None:
    config = read_model_config("random:tiny")
    mine, _, _ = load_model("random:tiny", shard=RankWeights(TPLayout(config, 2, 0)))
    with pytest.raises(ValueError, match="another model's"):
        shard_model(mine, TPLayout(config, 4, 0), None, tree=False)


@pytest.mark.parametrize("spec", ["hf", "random:tiny"])
def test_a_tp_engine_never_builds_the_whole_model(spec: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a TP=2 engine builds only its shard (a random shape's whole model exists
    only on the meta device, for its names), and answers greedy requests like TP=1."""
    from detserve.engine import LLMEngine
    from detserve.model.llama import LlamaModel
    from detserve.params import SamplingParams

    model = str(make_random_llama(num_layers=2, max_position_embeddings=256)) \
        if spec == "hf" else spec
    whole = read_model_config(model)
    built: list[tuple[int, str]] = []
    init = LlamaModel.__init__

    def record(self: LlamaModel, config: object, *args: object, **kw: object) -> None:
        init(self, config, *args, **kw)  # type: ignore[arg-type]
        built.append((self.config.num_heads, str(self.embed_tokens.device)))

    monkeypatch.setattr(LlamaModel, "__init__", record)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = {}
    for tp in (2, 1):
        engine = LLMEngine.from_args(model, "nondeterministic", tensor_parallel_size=tp,
                                     max_model_len=128)
        try:
            if tp == 2:
                assert (whole.num_heads, "cpu") not in built
                assert (whole.num_heads // 2, "cpu") in built
            engine.add_request("r", None, params, prompt_token_ids=[5, 9, 14, 3])
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens[tp] = out.token_ids
        finally:
            engine.close()
    assert tokens[2] == tokens[1]


def test_a_shape_cut_to_its_first_layers() -> None:
    """``random:<shape>@N``: the shape's first N layers, drawn as the whole shape draws
    them (to study a large shape's numerics on one device); bad counts are refused."""
    whole, _, _ = load_model("random:tiny")
    cut, _, info = load_model("random:tiny@1")
    assert cut.config.num_layers == 1 and info.name == "random-tiny@1"
    first = _params(whole)
    for name, p in _params(cut).items():
        if name.startswith("layers.") or name == "embed_tokens":
            assert torch.equal(p, first[name]), name
    assert read_model_config("random:llama3-70b@40").num_layers == 40
    for bad in ("tiny@0", "tiny@3", "tiny@x", "tiny@"):
        with pytest.raises(ValueError, match="layer count"):
            read_model_config(f"random:{bad}")
