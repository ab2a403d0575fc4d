"""The serve config is one: `services.serve_config` builds what `detserve serve` runs and
what the RayService's serveConfigV2 carries; and the image matches the manifests."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # deploy/ is not an installed package

from deploy.k8s import manifests as m  # noqa: E402
from deploy.k8s.render import render  # noqa: E402
from services import serve_config as sc  # noqa: E402

K8S = ROOT / "deploy" / "k8s"


def rendered_serve_config(name: str) -> str:
    objects = render(K8S / "overlays" / name)
    (service,) = [o for o in objects if o["kind"] == "RayService"]
    text = service["spec"]["serveConfigV2"]
    assert isinstance(text, str)
    return text


# --- services.serve_config ---------------------------------------------------------------

def test_default_config_shape() -> None:
    config = sc.default_serve_config()
    (app,) = config["applications"]
    assert app == {
        "name": "detserve",
        "route_prefix": "/",
        "import_path": "services.app:build_app",
        "args": dict(sc.DEFAULT_ARGS),
    }
    assert list(app["args"]) == list(sc.ARG_NAMES)
    assert config["http_options"]["port"] == 8000
    assert config["grpc_options"]["port"] == 9000
    assert yaml.safe_load(yaml.safe_dump(config)) == config


def test_overrides_are_applied_and_validated() -> None:
    config = sc.default_serve_config(model="/models/x.gguf", verify_window=32, http_port=8080)
    args = config["applications"][0]["args"]
    assert (args["model"], args["verify_window"], args["verify_group"]) == (
        "/models/x.gguf", 32, 8)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8080}


@pytest.mark.parametrize("overrides, message", [
    ({"verify_windw": 32}, "unknown serve args"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"device": "tpu"}, "device must be one of"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"verify_window": 0}, "verify_window must be >= 1"),
    ({"verify_group": True}, "verify_group must be an integer"),
    ({"num_verifiers": 0}, "mode 'llm42' needs num_verifiers >= 1"),
    ({"verifier_gpu_fraction": 0.5}, "must be 0 when device is 'cpu'"),
    ({"device": "cuda"}, "must be > 0 when verifiers share the decoders' GPUs"),
    ({"device": "cuda", "verifier_gpu_fraction": 0.25, "dedicated_verifiers": True},
     "must be 0 with dedicated_verifiers"),
    ({"device": "cuda", "verifier_gpu_fraction": 1.5}, r"must be in \[0, 1\]"),
    ({"redis_url": "localhost:6379"}, "redis_url must start with"),
    ({"grpc_port": 8000}, "must differ"),
    ({"http_port": 70000}, r"http_port must be in \[1, 65535\]"),
    ({"model": " "}, "model must be a non-empty string"),
])
def test_bad_args_raise_clear_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sc.default_serve_config(**overrides)


def test_nondeterministic_mode_may_run_without_verifiers() -> None:
    config = sc.default_serve_config(mode="nondeterministic", num_verifiers=0)
    assert config["applications"][0]["args"]["num_verifiers"] == 0


def test_deployment_overrides() -> None:
    decoder = sc.DeploymentOverride(
        sc.DECODER, num_cpus=2, resources={"slot": 1}, max_ongoing_requests=32,
        autoscaling=sc.Autoscaling(min_replicas=1, initial_replicas=2, max_replicas=4,
                                   target_ongoing_requests=16))
    config = sc.default_serve_config(num_decoders=2, deployments=[decoder])
    (entry,) = config["applications"][0]["deployments"]
    assert entry["name"] == "Decoder" and entry["num_replicas"] == "auto"
    assert entry["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.0,
                                          "resources": {"slot": 1}}
    assert entry["autoscaling_config"]["initial_replicas"] == 2
    with pytest.raises(ValueError, match="initial_replicas must equal num_decoders"):
        sc.default_serve_config(num_decoders=1, deployments=[decoder])
    with pytest.raises(ValueError, match="repeat a name"):
        sc.default_serve_config(num_decoders=2, deployments=[decoder, decoder])
    with pytest.raises(ValueError, match="unknown deployment"):
        sc.DeploymentOverride("Decodr", num_cpus=1)
    with pytest.raises(ValueError, match="max_ongoing_requests >= target_ongoing_requests"):
        sc.DeploymentOverride(sc.DECODER, num_cpus=1, max_ongoing_requests=4,
                              autoscaling=sc.Autoscaling(1, 4, 1, target_ongoing_requests=8))
    with pytest.raises(ValueError, match="min_replicas <= initial_replicas <= max_replicas"):
        sc.Autoscaling(min_replicas=3, max_replicas=4, initial_replicas=2)
    verifier = sc.DeploymentOverride(sc.VERIFIER, num_cpus=1, num_gpus=0.5)
    with pytest.raises(ValueError, match="asks for 0.5 GPUs but device is 'cpu'"):
        sc.default_serve_config(deployments=[verifier])
    with pytest.raises(ValueError, match="must equal verifier_gpu_fraction"):
        sc.default_serve_config(device="cuda", verifier_gpu_fraction=0.25,
                                deployments=[verifier])


# --- tensor parallelism: GPUs per decoder, refusals up front ----------------------------

CUDA: dict[str, Any] = {"device": "cuda", "verifier_gpu_fraction": 0.25}
TP2: dict[str, Any] = {"device": "cuda", "tensor_parallel_size": 2, "num_verifiers": 0}
INVARIANT: dict[str, Any] = {"tp_invariant_lane": True}


def _args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = sc.default_serve_config(**overrides)["applications"][0]["args"]
    return args


@pytest.mark.parametrize("overrides, decoder, verifier, total", [
    ({}, 0.0, 0.0, 0.0),
    (CUDA, 0.75, 0.25, 1.0),
    ({**CUDA, "num_decoders": 2, "num_verifiers": 2}, 0.75, 0.25, 2.0),
    ({"device": "cuda", "dedicated_verifiers": True, "num_decoders": 3}, 1.0, 1.0, 4.0),
    # a mode without a lane deploys no verifier: its decoder keeps the whole GPU
    ({**CUDA, "mode": "nondeterministic"}, 1.0, 0.25, 1.0),
    (TP2, 2.0, 0.0, 2.0),
    ({**TP2, "num_decoders": 3}, 2.0, 0.0, 6.0),
    ({**TP2, "tensor_parallel_size": 4, "mode": "nondeterministic"}, 4.0, 0.0, 4.0),
])
def test_gpus_per_replica(overrides: dict[str, Any], decoder: float, verifier: float,
                          total: float) -> None:
    args = _args(**overrides)
    assert sc.decoder_gpus(args) == decoder
    assert sc.verifier_gpus(args) == verifier
    assert sc.gpus_needed(args) == total


def test_too_few_gpus_is_a_clear_error() -> None:
    args = _args(**TP2, num_decoders=2)
    sc.check_gpu_count(args, 4.0)
    sc.check_gpu_count(args, 8.0)
    with pytest.raises(RuntimeError, match=r"needs 4 GPUs \(2 decoders x 2 "
                                           r"\(tensor_parallel_size 2\)\) but this Ray "
                                           r"cluster has 3"):
        sc.check_gpu_count(args, 3.0)
    colocated = _args(**CUDA, num_decoders=2, num_verifiers=2)
    sc.check_gpu_count(colocated, 2.0)
    with pytest.raises(RuntimeError, match=r"2 decoders x 0.75 \+ 2 verifiers x 0.25"):
        sc.check_gpu_count(colocated, 1.0)
    sc.check_gpu_count(_args(), 0.0)  # CPU: nothing to check


def test_tp_refuses_verifiers_with_the_engines_own_rule() -> None:
    engine = sc.engine_config(_args(**TP2), read_checkpoint=False)
    with pytest.raises(ValueError) as refusal:
        engine.check_outside_lane()
    for extra in (CUDA, {"device": "cuda", "dedicated_verifiers": True}, {"device": "cpu"}):
        with pytest.raises(ValueError, match="num_verifiers must be 0") as e:
            sc.default_serve_config(**{**TP2, **extra, "num_verifiers": 1})
        assert str(refusal.value) in str(e.value)  # the engine's words, not a copy
    # llm42 verifies on the decoder's ranks: no verifier replica is needed
    assert _args(**TP2)["mode"] == "llm42"
    # a mode without a lane deploys no verifier, so num_verifiers does not matter
    assert _args(**{**TP2, "device": "cpu", "mode": "nondeterministic", "num_verifiers": 1})


def test_tp_placement_of_dedicated_verifiers() -> None:
    """With the invariant lane the engine hands a TP lane to verifiers: a co-located one has
    no GPU share to take (Ray gives more than one GPU only whole); a dedicated one does."""
    with pytest.raises(ValueError, match="holds its GPUs whole"):
        sc.default_serve_config(**{**TP2, **CUDA, **INVARIANT, "num_verifiers": 1})
    args = _args(**{**TP2, **INVARIANT, "num_verifiers": 2, "dedicated_verifiers": True})
    assert (sc.decoder_gpus(args), sc.verifier_gpus(args), sc.gpus_needed(args)) == (2, 1, 4)
    # llm42 without verifier replicas: at TP=1 refused, at TP>1 the lane runs on the
    # decoder's own ranks (invariant or not)
    with pytest.raises(ValueError, match="llm42' needs num_verifiers >= 1"):
        sc.default_serve_config(**{**CUDA, "num_verifiers": 0})
    assert _args(**{**TP2, **INVARIANT})["num_verifiers"] == 0


def test_verifiers_at_tp_size_above_one() -> None:
    """A verifier replica over several ranks: only dedicated, with the invariant lane, a
    power of two; on CUDA it holds that many whole GPUs."""
    ok = {**INVARIANT, "dedicated_verifiers": True, "verifier_tensor_parallel_size": 2}
    args = _args(**{**ok, "device": "cuda", "num_verifiers": 1})
    assert (sc.decoder_gpus(args), sc.verifier_gpus(args), sc.gpus_needed(args)) == (1, 2, 3)
    args = _args(**{**ok, **TP2, "num_verifiers": 2})
    assert sc.gpus_needed(args) == 2 + 2 * 2
    for extra, words in [
            ({"dedicated_verifiers": False, "verifier_gpu_fraction": 0.25, "device": "cuda"},
             ["--dedicated-verifiers", "--tp-invariant-lane"]),
            ({"tp_invariant_lane": False}, ["--tp-invariant-lane"]),
            ({"verifier_tensor_parallel_size": 3}, ["power of two"])]:
        with pytest.raises(ValueError) as e:
            sc.default_serve_config(**{**ok, **extra})
        for word in words:
            assert word in str(e.value), (word, str(e.value))


# the combinations a TP decoder's verifiers come in: accepted only dedicated, with the
# invariant lane; every refusal names the flags that fix it
TP_CPU: dict[str, Any] = {"tensor_parallel_size": 2, "num_verifiers": 1}


@pytest.mark.parametrize("extra", [
    {**INVARIANT, "dedicated_verifiers": True},
    {**INVARIANT, "dedicated_verifiers": True, "device": "cuda", "num_verifiers": 3},
    {**INVARIANT, "dedicated_verifiers": True, "tensor_parallel_size": 4, "mode": "lane_only"},
    {**INVARIANT, "num_verifiers": 0},
    {"num_verifiers": 0},
    {**INVARIANT, "mode": "nondeterministic"},  # no lane: no verifier deployed
], ids=["cpu", "cuda", "tp4-lane-only", "own-ranks-invariant", "own-ranks", "no-lane"])
def test_tp_verifier_combinations_accepted(extra: dict[str, Any]) -> None:
    args = _args(**{**TP_CPU, **extra})
    engine = sc.engine_config(args, read_checkpoint=False)
    assert engine.tensor_parallel_size == args["tensor_parallel_size"] > 1
    if sc.verifiers_deployed(args):
        engine.check_outside_lane()  # the engine takes the verifiers the config deploys
        assert args["dedicated_verifiers"] and args["tp_invariant_lane"]


@pytest.mark.parametrize("extra, words", [
    # co-located: a sharded pool cannot be mapped (on CUDA nor shared)
    (INVARIANT, ["cannot be mapped", "--dedicated-verifiers", "--num-verifiers 0"]),
    ({**INVARIANT, **CUDA}, ["cannot be mapped", "holds its GPUs whole",
                             "--dedicated-verifiers"]),
    # dedicated without the invariant lane: a TP=1 verifier cannot reproduce its bits
    ({"dedicated_verifiers": True}, ["only with tp_invariant_lane", "--tp-invariant-lane",
                                     "--dedicated-verifiers", "--num-verifiers 0"]),
    ({"dedicated_verifiers": True, "device": "cuda"}, ["--tp-invariant-lane"]),
    ({"mode": "lane_only"}, ["--tp-invariant-lane", "num_verifiers must be 0"]),
], ids=["colocated", "colocated-cuda", "dedicated-plain", "dedicated-plain-cuda",
        "colocated-plain"])
def test_tp_verifier_combinations_refused(extra: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        sc.default_serve_config(**{**TP_CPU, **extra})
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_serve_cli_accepts_tp_with_dedicated_verifiers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags reach the config, and it passes the checks (Redis is the first thing
    started, stopped here)."""
    from services import cli
    from services.console import main

    class Started(Exception):
        pass

    def started(*a: Any, **kw: Any) -> None:
        raise Started

    monkeypatch.setattr(cli, "_ensure_free", started)
    monkeypatch.setattr(cli, "_embedded_redis", started)
    with pytest.raises(Started):
        main(["serve", "--tensor-parallel-size", "2", "--tp-invariant-lane",
              "--dedicated-verifiers", "--num-verifiers", "1"])


def test_decoder_override_must_reserve_the_tp_gpus() -> None:
    def decoder(gpus: float) -> sc.DeploymentOverride:
        return sc.DeploymentOverride(sc.DECODER, num_cpus=1, num_gpus=gpus)

    sc.default_serve_config(**TP2, deployments=[decoder(2)])
    with pytest.raises(ValueError, match=r"Decoder num_gpus 1 must be 2 \(tensor_parallel_size "
                                         r"2\)"):
        sc.default_serve_config(**TP2, deployments=[decoder(1)])
    sc.default_serve_config(**CUDA, deployments=[decoder(0.75)])
    with pytest.raises(ValueError, match="must be 0.75 .*less the co-located verifier's share"):
        sc.default_serve_config(**CUDA, deployments=[decoder(1)])


def test_serve_cli_refuses_tp_with_verifiers_before_starting_anything(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from services import cli
    from services.console import main

    def started(*a: Any, **kw: Any) -> None:
        raise AssertionError("nothing may start before the args are checked")

    monkeypatch.setattr(cli, "_ensure_free", started)
    monkeypatch.setattr(cli, "_embedded_redis", started)
    assert main(["serve", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "detserve serve: error:" in err and "num_verifiers must be 0" in err


def test_local_serve_refuses_a_cluster_with_too_few_gpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One Ray node with 3 GPUs, two TP=2 decoders: an error before Ray Serve starts (which
    would keep a decoder pending for ever), and Ray shut down again."""
    from contextlib import ExitStack

    import ray
    from ray import serve

    from services.local import start_local_serve

    calls: list[str] = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append("init"))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 3.0})
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append("start"))
    monkeypatch.setattr("os.environ", {})
    config = sc.default_serve_config(**TP2, num_decoders=2)
    with pytest.raises(RuntimeError, match="needs 4 GPUs .* has 3"):
        with ExitStack() as stack:
            start_local_serve(stack, config)
    assert calls == ["init", "shutdown"]


def test_serve_config_module_does_not_import_ray() -> None:
    source = (ROOT / "services" / "serve_config.py").read_text()
    assert not re.search(r"^\s*(import|from)\s+ray\b", source, re.MULTILINE)


# --- the RayService carries exactly that config ------------------------------------------

@pytest.mark.parametrize("overlay", m.OVERLAYS, ids=lambda o: o.name)
def test_serveconfigv2_is_the_shared_config(overlay: m.Overlay) -> None:
    expected = yaml.safe_dump(sc.default_serve_config(
        deployments=overlay.deployments, http_host="0.0.0.0", **overlay.serve_args))
    assert rendered_serve_config(overlay.name) == expected


@pytest.mark.parametrize("overlay", m.OVERLAYS, ids=lambda o: o.name)
def test_engine_configmap_mirrors_the_serve_args(overlay: m.Overlay) -> None:
    args = yaml.safe_load(rendered_serve_config(overlay.name))["applications"][0]["args"]
    objects = render(K8S / "overlays" / overlay.name)
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert configmap["data"] == {f"DETSERVE_{k.upper()}": str(v) for k, v in args.items()}


@pytest.mark.parametrize("name", [o.name for o in m.OVERLAYS])
def test_serveconfigv2_parses_as_a_ray_serve_deploy_config(name: str) -> None:
    schema = pytest.importorskip("ray.serve.schema")
    config = schema.ServeDeploySchema.model_validate(
        yaml.safe_load(rendered_serve_config(name)))
    (app,) = config.applications
    assert app.import_path == sc.IMPORT_PATH
    assert {d.name for d in app.deployments} <= set(sc.DEPLOYMENT_NAMES)


def _import_app_module() -> Any:
    return importlib.import_module(sc.IMPORT_PATH.split(":")[0])


@pytest.mark.parametrize("name", [o.name for o in m.OVERLAYS])
def test_app_builds_from_the_rayservice_config_without_kubernetes(name: str) -> None:
    serve = pytest.importorskip("ray.serve")
    module = _import_app_module()
    (app_config,) = yaml.safe_load(rendered_serve_config(name))["applications"]
    build_app = getattr(module, sc.IMPORT_PATH.split(":")[1])
    app = build_app(app_config["args"])
    assert isinstance(app, serve.Application)
    # Ray Serve refuses a config that overrides a deployment the app does not define.
    from ray.serve._private.build_app import build_app as build_deployments

    built = build_deployments(app, name=app_config["name"])
    names = {d.name for d in built.deployments}
    assert {d["name"] for d in app_config.get("deployments", [])} <= names
    # the app's own placement is the overlay's: a decoder holds its TP ranks' GPUs
    (decoder,) = [d for d in built.deployments if d.name == sc.DECODER]
    assert (decoder.ray_actor_options or {})["num_gpus"] == sc.decoder_gpus(app_config["args"])
    for override in app_config.get("deployments", []):
        if override["name"] == sc.DECODER:
            assert override["ray_actor_options"]["num_gpus"] == sc.decoder_gpus(
                app_config["args"])
    for path in yaml.safe_load(rendered_serve_config(name))["grpc_options"][
            "grpc_servicer_functions"]:
        module_name, _, attr = path.partition(":")
        assert callable(getattr(importlib.import_module(module_name), attr)), path


# --- the image recipe matches the manifests ----------------------------------------------

def test_dockerfile_matches_ray_version_and_project_version() -> None:
    dockerfile = (K8S / "Dockerfile").read_text()
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    base = re.search(r"^ARG RAY_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert ray_version and base, "Dockerfile must set ARG RAY_VERSION and ARG RAY_IMAGE"
    assert ray_version.group(1) == m.RAY_VERSION
    image = base.group(1).replace("${RAY_VERSION}", ray_version.group(1))
    assert image.startswith(f"rayproject/ray:{m.RAY_VERSION}-")
    assert image.endswith("-gpu") or "-cu" in image, "needs a CUDA base"
    assert re.search(r"^FROM \$\{RAY_IMAGE\}$", dockerfile, re.MULTILINE)
    assert "VOLUME" in dockerfile and m.MODEL_CACHE_PATH in dockerfile
    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE)
    assert version and m.PROJECT_IMAGE == f"detserve:{version.group(1)}"
    assert f'"ray[serve]=={m.RAY_VERSION}"' in pyproject


# ---- Ray Serve's environment for local runs (direct ingress, throughput profile) --------
def test_ray_serve_env_gives_the_router_replica_the_configured_ports() -> None:
    env = sc.ray_serve_env(8000, 9000)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert float(env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) >= 30  # slow machines start
    # Ray Serve allocates from range(MIN, MAX): exactly the configured port
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
            env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8000", "8001")
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"],
            env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"]) == ("9000", "9001")
    proxied = sc.ray_serve_env(8000, 9000, direct_ingress=False)
    assert proxied["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    # every HTTP server Serve starts (proxy or router replica) answers broken framing as JSON
    for e in (env, proxied):
        assert e["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == sc.HTTP_PROXY_CALLBACK
    assert not any("_PORT" in key for key in proxied)


def test_apply_ray_serve_env_keeps_the_users_switches_but_always_sets_ports() -> None:
    environ = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
               "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "1234"}
    in_effect = sc.apply_ray_serve_env(8100, 9100, environ=environ)
    assert environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"  # the user's choice stands
    assert environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8100"  # a stale port does not
    assert environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert in_effect["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"


def test_serve_start_options_move_the_fallback_proxy_off_the_routers_ports() -> None:
    config = sc.default_serve_config(http_port=8000, grpc_port=9000)
    http, grpc = sc.serve_start_options(config, sc.ray_serve_env(8000, 9000), (41000, 42000))
    assert (http["port"], grpc["port"]) == (41000, 42000)
    assert grpc["grpc_servicer_functions"] == list(sc.GRPC_SERVICER_FUNCTIONS)
    assert config["http_options"]["port"] == 8000  # the config itself is left alone
    http, grpc = sc.serve_start_options(config, {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"},
                                        (41000, 42000))
    assert (http["port"], grpc["port"]) == (8000, 9000)


def test_local_serve_start_survives_a_restarted_first_proxy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When the controller kills the first proxy before it is ready (a slow start on a
    loaded machine; seen in CI), ``serve.start`` raises; the controller is up by then, and
    a second call connects to it. Ray itself is not started here (its calls are recorded)."""
    from contextlib import ExitStack

    import ray
    from ray import serve

    from services.local import start_local_serve

    calls: list[str] = []

    def start(**kw: Any) -> None:
        calls.append("start")
        if calls.count("start") == 1:
            raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "init", lambda **kw: calls.append("init"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    environ: dict[str, str] = {}
    monkeypatch.setattr("os.environ", environ)
    with ExitStack() as stack:
        start_local_serve(stack, sc.default_serve_config())
    assert calls == ["init", "start", "start", "serve.shutdown", "shutdown"]
    assert environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "60"


def test_stream_interval_is_an_optional_validated_arg() -> None:
    config = sc.default_serve_config(stream_interval=4)
    assert config["applications"][0]["args"]["stream_interval"] == 4
    assert "stream_interval" not in sc.default_serve_config()["applications"][0]["args"]
    for bad in (0, -1, 1.5, "4", True, 10**6):
        with pytest.raises(ValueError, match="stream_interval"):
            sc.default_serve_config(stream_interval=bad)


@pytest.mark.parametrize("overlay", [o.name for o in m.OVERLAYS])
def test_every_ray_pod_gets_the_throughput_profile_with_proxies_kept(overlay: str) -> None:
    (service,) = [o for o in render(K8S / "overlays" / overlay) if o["kind"] == "RayService"]
    spec = service["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]] + list(spec["workerGroupSpecs"])
    for pod in pods:
        for container in pod["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
            assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"  # Services route to proxies


def test_a_tp_verifier_reserves_a_gpu_a_rank() -> None:
    """A dedicated verifier at verifier_tensor_parallel_size 2 reserves 2 whole GPUs: an
    override giving it 1 is refused (its second rank would find no GPU)."""
    o = m.overlay("tp-2-verifier")
    verifier = next(d for d in o.deployments if d.name == "Verifier")
    assert verifier.num_gpus == 2
    bad = tuple(dataclasses.replace(d, num_gpus=1) if d is verifier else d
                for d in o.deployments)
    with pytest.raises(ValueError, match="a dedicated verifier has 2 GPUs of its own"):
        sc.default_serve_config(deployments=bad, http_host="0.0.0.0", **o.serve_args)
