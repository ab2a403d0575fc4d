"""Each option is declared once, as a config field with its help text, and the flags of
``detserve generate``, ``detserve serve``, the verifier replica and ``bench_offline`` (the
engine's, the requests' and its own) are generated from it: the same names and defaults
everywhere."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from benchmarks.bench_offline import OfflineOptions, RequestOptions
from detserve.config import CacheConfig, EngineConfig, SamplerConfig, SchedulerConfig
from detserve.flags import add_flags, engine_kwargs, engine_options, options
from services.serve_config import OPTIONAL_ARGS, OPTIONS, ServeConfig
from services.verifier import replica
from services.verifier.replica import ReplicaOptions


@pytest.mark.parametrize("cls", [EngineConfig, SchedulerConfig, CacheConfig, SamplerConfig,
                                 ServeConfig, ReplicaOptions, RequestOptions, OfflineOptions])
def test_every_option_has_help_text(cls: type) -> None:
    nested = (SchedulerConfig, CacheConfig, SamplerConfig)
    for f in dataclasses.fields(cls):
        if f.default_factory in nested:  # type: ignore[comparison-overlap]
            continue  # (a nested config: its own fields are the options)
        assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name} has no help"
    assert set(options(cls)) == {f.name for f in dataclasses.fields(cls)
                                 if f.default_factory not in nested}  # type: ignore[comparison-overlap]


def _engine_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[tuple[str, ...], Any]]:
    """dest -> (option strings, default) of the parser's engine flags."""
    names = set(engine_options())
    return {a.dest: (tuple(a.option_strings), a.default) for a in parser._actions
            if a.dest in names}


def _subparser(name: str) -> argparse.ArgumentParser:
    from services.console import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_generate_serve_and_bench_offline_flags_agree() -> None:
    from benchmarks import bench_offline

    generate = _engine_flags(_subparser("generate"))
    serve = _engine_flags(_subparser("serve"))
    bench = _engine_flags(bench_offline.build_parser())
    assert set(generate) == set(serve) == set(engine_options())
    # one difference, on purpose: a served engine's length is concrete (the router's limits
    # are built from it); offline it is the model's (None: EngineConfig.create reads it)
    own = ("max_model_len",)
    assert {k: v for k, v in generate.items() if k not in own} == {
        k: v for k, v in serve.items() if k not in own}
    assert generate["max_model_len"][1] is None and serve["max_model_len"][1] == 2048
    # bench_offline: the mode is per run (--modes), the model a random-weight one, and the
    # length the one its recorded runs used
    assert set(bench) == set(generate) - {"mode"}
    assert {k: v for k, v in bench.items() if k not in ("model", *own)} == {
        k: v for k, v in generate.items() if k not in ("mode", "model", *own)}
    assert bench["model"] == (generate["model"][0], "random:tiny")
    assert bench["max_model_len"][1] == 2048
    for name, (strings, default) in generate.items():
        assert strings[0] == "--" + name.replace("_", "-")
        if name not in ("num_blocks", "max_model_len"):  # (None: EngineConfig.create's)
            assert default == engine_options()[name].default
    assert generate["verify_window"][0] == ("--verify-window", "-W")
    assert generate["verify_group"][0] == ("--verify-group", "-G")
    assert generate["lane_decode_in_mixed_steps"][0] == ("--lane-decode-in-mixed-steps",
                                                         "--no-lane-decode-in-mixed-steps")


def test_parsed_flags_build_the_engine_config_and_the_serve_args() -> None:
    """Parsed engine flags give ``EngineConfig.create`` every option; the serve command's
    defaults leave the app args at their defaults (only changed options travel)."""
    from services.cli import serve_config_from
    from services.serve_config import DEFAULT_ARGS

    a = _subparser("generate").parse_args(
        ["--prompt", "x", "-W", "8", "-G", "2", "--no-lane-dot-sums", "--gumbel-chunk-rows",
         "3", "--num-blocks", "300", "--max-model-len", "256",
         "--no-lane-decode-in-mixed-steps", "--lane-sms", "16"])
    cfg = EngineConfig.create(a.model, **engine_kwargs(a))
    assert (cfg.scheduler.verify_window, cfg.scheduler.verify_group) == (8, 2)
    assert not cfg.lane_dot_sums and cfg.sampling.gumbel_chunk_rows == 3
    assert cfg.cache.num_blocks == 300 and cfg.lane_sms == 16
    assert not cfg.scheduler.lane_decode_in_mixed_steps
    assert EngineConfig.create(a.model, **engine_kwargs(_subparser("generate").parse_args(
        ["--prompt", "x"]))) == EngineConfig.create("smollm2")
    serve = _subparser("serve")
    args = serve_config_from(serve.parse_args([]), DEFAULT_ARGS["redis_url"])
    assert args["applications"][0]["args"] == dict(DEFAULT_ARGS)
    changed = serve_config_from(serve.parse_args(["--no-lane-dot-sums", "--seed", "3"]),
                                DEFAULT_ARGS["redis_url"])["applications"][0]["args"]
    assert (changed["lane_dot_sums"], changed["seed"]) == (False, 3)
    assert set(OPTIONAL_ARGS) == set(OPTIONS) - set(DEFAULT_ARGS)


def test_flag_types_follow_the_fields() -> None:
    """Booleans as --x/--no-x, optional values absent as None, choices from the config's
    validation constants; an option's value check names it."""
    from detserve.config import DTYPE_CHOICES, MODES

    p = argparse.ArgumentParser()
    add_flags(p, engine_options())
    assert p.parse_args([]).async_scheduling is None
    assert p.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert p.parse_args(["--prefill-batch-tokens", "7"]).prefill_batch_tokens == 7
    opts = engine_options()
    assert opts["mode"].choices == MODES and opts["dtype"].choices == DTYPE_CHOICES
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "turbo"])
    with pytest.raises(ValueError, match="lane_dot_sums"):
        opts["lane_dot_sums"].check(1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        opts["max_num_seqs"].check(2.5)
    opts["lane_bound_fraction"].check(1)  # (an int is a float's value)


def test_the_replica_flags_are_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m services.verifier.replica``: one flag per ``ReplicaOptions`` field (and
    the older ``--ttl``), and a bad command line is refused by name, exit status 2."""
    parser = argparse.ArgumentParser()
    add_flags(parser, options(ReplicaOptions))
    ns = parser.parse_args(["--model", "random:tiny", "--redis-url", "redis://h:1",
                            "--ttl", "1.5", "--kv-blocks", "64", "--tensor-parallel-size",
                            "2"])
    opts = ReplicaOptions(**vars(ns))
    assert (opts.ttl_s, opts.kv_blocks, opts.tensor_parallel_size) == (1.5, 64, 2)
    assert dataclasses.asdict(ReplicaOptions(model="m", redis_url="r")) == {
        **{f.name: f.default for f in dataclasses.fields(ReplicaOptions)},
        "model": "m", "redis_url": "r"}
    for argv, words in ((["--model", "m"], "--redis-url is required"),
                        (["--model", "m", "--redis-url", "r", "--tensor-parallel-size", "2"],
                         "needs --kv-blocks"),
                        (["--model", "m", "--redis-url", "r", "--port", "x"],
                         "invalid int value")):
        with pytest.raises(SystemExit) as e:
            replica.main(argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err
