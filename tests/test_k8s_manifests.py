"""deploy/k8s: overlays render, validate against upstream/KubeRay schemas, and obey policy.

Offline: needs pyyaml, jsonschema and kubernetes-validate, not a cluster. The comparison
with real kustomize runs only where `kubectl` is installed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # deploy/ is not an installed package

from deploy.k8s import manifests as m  # noqa: E402
from deploy.k8s.generate import stale_files  # noqa: E402
from deploy.k8s.policy import check_policies, image_pinned  # noqa: E402
from deploy.k8s.render import UnsupportedKustomization, object_id, render  # noqa: E402
from deploy.k8s.validate import (  # noqa: E402
    K8S_VERSION,
    crd_schema,
    openapi_to_jsonschema,
    validate_object,
    validate_objects,
)

K8S = ROOT / "deploy" / "k8s"
OVERLAY_NAMES = [o.name for o in m.OVERLAYS]
Obj = dict[str, Any]


@pytest.fixture(scope="module", params=OVERLAY_NAMES)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, render(K8S / "overlays" / request.param)


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def the(objects: list[Obj], kind: str) -> Obj:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def cluster_of(objects: list[Obj]) -> Obj:
    return the(objects, "RayService")["spec"]["rayClusterConfig"]


def ray_container(template: Obj) -> Obj:
    return template["spec"]["containers"][0]


# --- every manifest parses; overlays render as kustomize renders them -------------------

def test_every_yaml_file_parses() -> None:
    files = [p for p in K8S.rglob("*.yaml") if "crds" not in p.parts]
    assert len(files) >= 12
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"


def test_overlays_exist_and_render(rendered: tuple[str, list[Obj]]) -> None:
    _, objects = rendered
    kinds = {o["kind"] for o in objects}
    assert {"RayService", "StatefulSet", "Service", "NetworkPolicy", "ConfigMap", "Ingress",
            "PodDisruptionBudget", "PersistentVolumeClaim"} <= kinds
    assert sorted(OVERLAY_NAMES) == sorted(p.name for p in (K8S / "overlays").iterdir())


def test_generated_files_are_up_to_date() -> None:
    assert stale_files() == [], "run: python -m deploy.k8s.generate"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("name", OVERLAY_NAMES)
def test_renderer_matches_real_kustomize(name: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / name)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]
    mine = render(K8S / "overlays" / name)
    assert sorted(mine, key=object_id) == sorted(theirs, key=object_id)


def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [cm.yaml]\nnamePrefix: x-\n")
    with pytest.raises(UnsupportedKustomization, match="namePrefix"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: [cm.yaml, cm.yaml]\n")
    with pytest.raises(ValueError, match="defined twice"):
        render(tmp_path)
    outside = tmp_path / "sub"
    outside.mkdir()
    (outside / "kustomization.yaml").write_text("resources: [../cm.yaml]\n")
    with pytest.raises(ValueError, match="outside the kustomization root"):
        render(outside)


# --- schemas: core kinds upstream (strict), KubeRay kinds against the CRDs ---------------

def test_rendered_overlays_validate(rendered: tuple[str, list[Obj]]) -> None:
    name, objects = rendered
    assert validate_objects(objects) == [], name


def test_core_validation_uses_the_pinned_kubernetes_version(
        rendered: tuple[str, list[Obj]]) -> None:
    _, objects = rendered
    service = by_kind(objects, "Service")[0]
    assert kubernetes_validate.validate(service, K8S_VERSION, strict=True) == "1.30"


def test_crd_copies_are_in_the_repo_with_their_license() -> None:
    crds = K8S / "crds"
    assert (crds / "LICENSE-kuberay").read_text().lstrip().startswith("Apache License")
    for name in ("ray.io_rayservices.yaml", "ray.io_rayclusters.yaml"):
        crd = yaml.load((crds / name).read_text(), Loader=getattr(yaml, "CSafeLoader",
                                                                      yaml.SafeLoader))
        assert crd["kind"] == "CustomResourceDefinition"
        assert crd["spec"]["group"] == "ray.io"


def test_conversion_rejects_unknown_fields_and_honours_openapi_extensions() -> None:
    schema = openapi_to_jsonschema({
        "type": "object",
        "properties": {
            "port": {"x-kubernetes-int-or-string": True,
                     "anyOf": [{"type": "integer"}, {"type": "string"}]},
            "when": {"type": "string", "nullable": True},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    })
    assert schema["additionalProperties"] is False
    assert schema["properties"]["when"]["type"] == ["string", "null"]
    assert "additionalProperties" not in schema["properties"]["free"]
    assert schema["properties"]["labels"]["additionalProperties"] == {"type": "string"}


def _gpu8() -> list[Obj]:
    return render(K8S / "overlays" / "gpu-8")


@pytest.mark.parametrize("path, field", [
    (("spec",), "serveConfig"),  # the v1alpha1-era field name
    (("spec", "rayClusterConfig", "headGroupSpec"), "replicas"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0), "gpus"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec", "containers", 0),
     "resource"),
    (("metadata",), "label"),
])
def test_crd_validation_rejects_unknown_fields(path: tuple[Any, ...], field: str) -> None:
    service = copy.deepcopy(the(_gpu8(), "RayService"))
    node: Any = service
    for key in path:
        node = node[key]
    node[field] = 1
    errors = validate_object(service)
    assert any(f"'{field}' was unexpected" in e for e in errors), errors


def test_crd_validation_rejects_wrong_types_and_missing_required_fields() -> None:
    service = copy.deepcopy(the(_gpu8(), "RayService"))
    group = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["replicas"] = "4"
    del group["groupName"]
    errors = validate_object(service)
    assert any("'4' is not of type 'integer'" in e for e in errors), errors
    assert any("'groupName' is a required property" in e for e in errors), errors


def test_rayclusterconfig_is_checked_against_the_raycluster_crd() -> None:
    schema = crd_schema("ray.io", "RayCluster", "v1")
    assert schema["properties"]["spec"]["additionalProperties"] is False
    service = copy.deepcopy(the(_gpu8(), "RayService"))
    service["spec"]["rayClusterConfig"]["bogus"] = True
    errors = validate_object(service)
    assert any(e.startswith("RayService/detserve rayClusterConfig as RayCluster") and
               "'bogus' was unexpected" in e for e in errors), errors


def test_core_validation_rejects_unknown_fields_strictly() -> None:
    redis = copy.deepcopy(the(_gpu8(), "StatefulSet"))
    redis["spec"]["template"]["spec"]["containers"][0]["imagePolicy"] = "Always"
    errors = validate_object(redis)
    assert errors and "'imagePolicy' was unexpected" in errors[0]


def test_unknown_core_kind_is_an_error() -> None:
    errors = validate_object({"apiVersion": "v1", "kind": "Nonsense",
                              "metadata": {"name": "x"}})
    assert errors and "Couldn't find schema" in errors[0]


# --- policy ---------------------------------------------------------------------------

def test_rendered_overlays_pass_policy(rendered: tuple[str, list[Obj]]) -> None:
    name, objects = rendered
    assert check_policies(objects) == [], name


@pytest.mark.parametrize("image, ok", [
    ("detserve:0.1.0", True),
    ("redis:7.2.5-alpine", True),
    ("registry.example:5000/team/detserve:0.1.0", True),
    ("redis@sha256:" + "a" * 64, True),
    ("redis", False),
    ("redis:latest", False),
    ("registry.example:5000/team/detserve", False),
])
def test_image_pinning(image: str, ok: bool) -> None:
    assert image_pinned(image) is ok


def _mutated(mutate: Any) -> list[str]:
    objects = copy.deepcopy(_gpu8())
    mutate(objects)
    return check_policies(objects)


def test_policy_flags_container_without_limits() -> None:
    def drop_limits(objects: list[Obj]) -> None:
        del ray_container(cluster_of(objects)["headGroupSpec"]["template"])["resources"]["limits"]
    problems = _mutated(drop_limits)
    assert any("ray-head" in p and "no cpu limit" in p for p in problems), problems
    assert any("no memory limit" in p for p in problems), problems


def test_policy_flags_gpu_limit_without_request() -> None:
    def drop_gpu_request(objects: list[Obj]) -> None:
        worker = cluster_of(objects)["workerGroupSpecs"][0]["template"]
        del ray_container(worker)["resources"]["requests"]["nvidia.com/gpu"]
    assert any("nvidia.com/gpu request must equal its limit" in p
               for p in _mutated(drop_gpu_request))


def test_policy_flags_privileged_and_unpinned_containers() -> None:
    def privileged(objects: list[Obj]) -> None:
        container = the(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
        container["securityContext"]["privileged"] = True
        container["image"] = "redis:latest"
    problems = _mutated(privileged)
    assert any("privileged" in p for p in problems), problems
    assert any("'redis:latest' is not pinned" in p for p in problems), problems


def test_policy_flags_autoscaler_sidecar_without_resources() -> None:
    def drop(objects: list[Obj]) -> None:
        del cluster_of(objects)["autoscalerOptions"]["resources"]
    assert any("autoscaler sidecar: no cpu request" in p for p in _mutated(drop))


@pytest.mark.parametrize("peer", [
    {"namespaceSelector": {}},
    {"ipBlock": {"cidr": "0.0.0.0/0"}},
    {"podSelector": {"matchLabels": {"detserve.io/redis-client": "true"}},
     "namespaceSelector": {"matchLabels": {"team": "other"}}},
])
def test_policy_flags_redis_reachable_from_other_namespaces(peer: Obj) -> None:
    def open_up(objects: list[Obj]) -> None:
        the(objects, "NetworkPolicy")["spec"]["ingress"][0]["from"].append(peer)
    assert any("outside the namespace" in p for p in _mutated(open_up))


def test_policy_flags_missing_networkpolicy_and_exposed_redis() -> None:
    def expose(objects: list[Obj]) -> None:
        objects[:] = [o for o in objects if o["kind"] != "NetworkPolicy"]
        redis_svc = next(o for o in objects if o["kind"] == "Service"
                         and o["metadata"]["name"] == m.REDIS_NAME)
        redis_svc["spec"]["type"] = "LoadBalancer"
    problems = _mutated(expose)
    assert "Redis pods are not selected by any Ingress NetworkPolicy" in problems
    assert any("Redis exposed outside the cluster" in p for p in problems)


# --- what the deployment must look like ------------------------------------------------

def test_rayservice_shape(rendered: tuple[str, list[Obj]]) -> None:
    name, objects = rendered
    service = the(objects, "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    assert isinstance(service["spec"]["serveConfigV2"], str)
    cluster = cluster_of(objects)
    assert cluster["rayVersion"] == m.RAY_VERSION
    head = ray_container(cluster["headGroupSpec"]["template"])
    assert not any("gpu" in k for k in head["resources"]["limits"]), "head must be CPU-only"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert "decoder" in groups
    gpu_overlay = name != "cpu-demo"
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    tp = args.get("tensor_parallel_size", 1)
    for group_name, group in groups.items():
        resources = ray_container(group["template"])["resources"]
        if gpu_overlay:
            # a decoder pod holds its replica's tensor-parallel GPUs, a verifier pod its
            # replica's (dedicated: one a rank)
            gpus = (tp if group_name == "decoder"
                    else args.get("verifier_tensor_parallel_size", 1))
            assert resources["requests"]["nvidia.com/gpu"] == gpus
            assert resources["limits"]["nvidia.com/gpu"] == gpus
        else:
            assert "nvidia.com/gpu" not in resources["limits"]


def test_every_ray_container_still_runs_kuberays_ray_start(
        rendered: tuple[str, list[Obj]]) -> None:
    # With ray.io/overwrite-container-cmd, KubeRay runs our command verbatim: a container
    # that forgot to exec $KUBERAY_GEN_RAY_START_CMD would never join the cluster.
    _, objects = rendered
    service = the(objects, "RayService")
    assert service["metadata"]["annotations"][m.OVERWRITE_CMD_ANNOTATION] == "true"
    cluster = cluster_of(objects)
    templates = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        container = ray_container(template)
        assert container["command"] == ["/bin/bash", "-c", "--"]
        assert container["args"][0].endswith('exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"')


def test_health_probes(rendered: tuple[str, list[Obj]]) -> None:
    _, objects = rendered
    cluster = cluster_of(objects)
    for group in cluster["workerGroupSpecs"]:
        container = ray_container(group["template"])
        # readiness: /health (503 while requests would fail); liveness and startup: /livez,
        # which answers whatever Redis and the verifiers do (a restart mends neither)
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/livez", "port": 8000}
        # liveness must not fire during a cold start: the startup probe allows 30 minutes
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    head = ray_container(cluster["headGroupSpec"]["template"])
    # KubeRay deploys the app only once the head is ready: /health there would deadlock.
    assert "readinessProbe" not in head and "livenessProbe" not in head


def test_verifier_placement(rendered: tuple[str, list[Obj]]) -> None:
    name, objects = rendered
    cluster = cluster_of(objects)
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    config = yaml.safe_load(the(objects, "RayService")["spec"]["serveConfigV2"])
    deployments = {d["name"]: d for d in config["applications"][0]["deployments"]}
    decoder = deployments["Decoder"]["ray_actor_options"]
    # rayStartParams.resources is a JSON object inside a (shell-quoted) JSON string
    slots = {g: json.loads(json.loads(groups[g]["rayStartParams"]["resources"])) for g in groups}
    if name == "tp-2":
        # the lane runs on each decoder's own ranks: no verifier replica, no verifier slot
        assert config["applications"][0]["args"]["num_verifiers"] == 0
        assert "Verifier" not in deployments
        assert set(groups) == {"decoder"}
        assert slots["decoder"] == {m.DECODER_SLOT: 1}
        assert decoder["resources"] == {m.DECODER_SLOT: 1}
        assert not any("nvidia-cuda-mps-control" in ray_container(g["template"])["args"][0]
                       for g in groups.values())
        return
    verifier = deployments["Verifier"]["ray_actor_options"]
    if name in ("gpu-8", "tp-2-verifier"):
        args = config["applications"][0]["args"]
        assert set(groups) == {"decoder", "verifier"}
        assert slots["verifier"] == {m.VERIFIER_SLOT: 1}
        assert slots["decoder"] == {m.DECODER_SLOT: 1}
        # whole GPUs, one a rank (tp-2-verifier: TP=2 decoders, a TP=2 verifier whose
        # bits are the decoders' only with the TP-invariant lane)
        assert decoder["num_gpus"] == args.get("tensor_parallel_size", 1)
        assert verifier["num_gpus"] == args.get("verifier_tensor_parallel_size", 1)
        assert (name == "tp-2-verifier") == (verifier["num_gpus"] == 2
                                             and args.get("tp_invariant_lane") is True)
        # verifier pods cannot map a decoder's pool: they must verify by K/V transfer
        assert config["applications"][0]["args"]["dedicated_verifiers"] is True
    else:
        assert set(groups) == {"decoder"}
        assert slots["decoder"] == {m.DECODER_SLOT: 1, m.VERIFIER_SLOT: 1}
        assert verifier["num_gpus"] + decoder["num_gpus"] <= 1
    assert verifier["resources"] == {m.VERIFIER_SLOT: 1}
    assert decoder["resources"] == {m.DECODER_SLOT: 1}
    mps = [g for g in groups.values() if "nvidia-cuda-mps-control -d" in
           ray_container(g["template"])["args"][0]]
    # MPS exactly where two processes share one GPU: the co-located GPU overlay.
    assert len(mps) == (1 if name == "gpu-1" else 0)
    for group in mps:
        env = {e["name"]: e.get("value") for e in ray_container(group["template"])["env"]}
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == m.MPS_PIPE_DIR


def test_decoder_autoscaling_matches_worker_group(rendered: tuple[str, list[Obj]]) -> None:
    name, objects = rendered
    config = yaml.safe_load(the(objects, "RayService")["spec"]["serveConfigV2"])
    decoder = next(d for d in config["applications"][0]["deployments"]
                   if d["name"] == "Decoder")
    group = next(g for g in cluster_of(objects)["workerGroupSpecs"]
                 if g["groupName"] == "decoder")
    if name != "gpu-8":
        assert "autoscaling_config" not in decoder
        return
    scaling = decoder["autoscaling_config"]
    assert decoder["num_replicas"] == "auto"
    assert scaling["min_replicas"] < scaling["max_replicas"]
    assert decoder["max_ongoing_requests"] >= scaling["target_ongoing_requests"]
    # one decoder replica per one-GPU pod: the pod range must cover the replica range
    assert group["minReplicas"] == scaling["min_replicas"]
    assert group["maxReplicas"] == scaling["max_replicas"]
    assert group["replicas"] == scaling["initial_replicas"]
    assert cluster_of(objects)["enableInTreeAutoscaling"] is True


def test_redis_wiring(rendered: tuple[str, list[Obj]]) -> None:
    name, objects = rendered
    redis = the(objects, "StatefulSet")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": m.REDIS_NAME, "key": m.REDIS_SECRET_KEY}
    assert "requirepass" in container["args"][0] and "$REDIS_PASSWORD" in container["args"][0]
    service = next(o for o in by_kind(objects, "Service")
                   if o["metadata"]["name"] == m.REDIS_NAME)
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    config = yaml.safe_load(the(objects, "RayService")["spec"]["serveConfigV2"])
    url = config["applications"][0]["args"]["redis_url"]
    assert re.fullmatch(rf"redis://{service['metadata']['name']}:6379/\d+", url)
    cluster = cluster_of(objects)
    policy = the(objects, "NetworkPolicy")
    admitted = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    for template in [cluster["headGroupSpec"]["template"]] + [
            g["template"] for g in cluster["workerGroupSpecs"]]:
        labels = template["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in admitted.items()), "Ray pod not admitted"
        env = {e["name"]: e for e in ray_container(template)["env"]}
        password = env["REDIS_PASSWORD"]
        assert password["valueFrom"]["secretKeyRef"]["name"] == m.REDIS_NAME
        # the internal gRPC servers' secret comes from a Secret too, never from Redis
        assert env["DETSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"] == {
            "name": m.CLUSTER_SECRET_NAME, "key": m.CLUSTER_SECRET_KEY}
    secrets = by_kind(objects, "Secret")
    # only the CPU demo ships (public, demo) secrets; real deployments bring their own
    assert sorted(s["metadata"]["name"] for s in secrets) == (
        sorted([m.REDIS_NAME, m.CLUSTER_SECRET_NAME]) if name == "cpu-demo" else [])


def test_services_ingress_pdb_and_configmap(rendered: tuple[str, list[Obj]]) -> None:
    _, objects = rendered
    serve_service = the(objects, "RayService")["spec"]["serveService"]
    ports = {p["name"]: p["port"] for p in serve_service["spec"]["ports"]}
    assert ports == {"serve": 8000, "grpc": 9000}
    services = {o["metadata"]["name"] for o in by_kind(objects, "Service")}
    services.add(serve_service["metadata"]["name"])
    ingress = the(objects, "Ingress")
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == m.SERVE_SERVICE_NAME in services
            assert backend["port"]["number"] == 8000
    pdb = the(objects, "PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"]
    cluster = cluster_of(objects)
    for group in cluster["workerGroupSpecs"]:
        labels = group["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items())
    head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    assert not all(head_labels.get(k) == v for k, v in selector.items())
    configmap = the(objects, "ConfigMap")
    for template in [cluster["headGroupSpec"]["template"]]:
        refs = ray_container(template)["envFrom"]
        assert {"configMapRef": {"name": configmap["metadata"]["name"]}} in refs
    for key in ("DETSERVE_MODEL", "DETSERVE_MODE", "DETSERVE_VERIFY_WINDOW",
                "DETSERVE_VERIFY_GROUP"):
        assert key in configmap["data"]


def test_pod_volumes_resolve(rendered: tuple[str, list[Obj]]) -> None:
    _, objects = rendered
    claims = {o["metadata"]["name"] for o in by_kind(objects, "PersistentVolumeClaim")}
    cluster = cluster_of(objects)
    for template in [cluster["headGroupSpec"]["template"]] + [
            g["template"] for g in cluster["workerGroupSpecs"]]:
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for mount in ray_container(template)["volumeMounts"]:
            volume = volumes[mount["name"]]
            if mount["mountPath"] == m.SHM_PATH:
                assert volume["emptyDir"]["medium"] == "Memory"
                continue
            assert volume["persistentVolumeClaim"]["claimName"] in claims


def _quantity(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+)([KMGT]i)", text)
    assert match, f"unexpected quantity {text!r}"
    return int(match[1]) * units[match[2]]


def test_tensor_parallel_overlay() -> None:
    """tp-2: each decoder pod holds the GPUs of one decoder replica's ranks, the serve args
    carry the TP size, and NCCL gets a memory-backed /dev/shm and its interface."""
    objects = render(K8S / "overlays" / "tp-2")
    service = the(objects, "RayService")
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    tp = app["args"]["tensor_parallel_size"]
    assert tp == m.TP_SIZE == 2
    assert the(objects, "ConfigMap")["data"]["DETSERVE_TENSOR_PARALLEL_SIZE"] == str(tp)
    (decoder,) = [d for d in app["deployments"] if d["name"] == "Decoder"]
    assert decoder["ray_actor_options"]["num_gpus"] == tp
    (group,) = cluster_of(objects)["workerGroupSpecs"]
    container = ray_container(group["template"])
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == tp
    # every decoder replica has a pod of its own: as many pods as decoders, fixed
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == (
        app["args"]["num_decoders"])
    mounts = {v["mountPath"]: v["name"] for v in container["volumeMounts"]}
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    # a memory-backed volume counts in the container's memory: it must fit well inside
    assert 2**30 <= _quantity(shm["sizeLimit"]) <= _quantity(resources["limits"]["memory"]) // 4
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    # pods without TP ranks keep the runtime's /dev/shm and NCCL's own defaults
    head = ray_container(cluster_of(objects)["headGroupSpec"]["template"])
    assert all(v["mountPath"] != "/dev/shm" for v in head["volumeMounts"])
    assert "NCCL_SOCKET_IFNAME" not in {e["name"] for e in head["env"]}


def test_overlay_refuses_pods_whose_gpus_do_not_match_their_replicas() -> None:
    tp2 = m.overlay("tp-2")
    (group,) = tp2.groups
    with pytest.raises(ValueError, match="pods have 1 GPUs, the replicas their slots admit "
                                         "reserve 2"):
        dataclasses.replace(tp2, groups=(dataclasses.replace(group, gpus=1),))
    gpu1 = m.overlay("gpu-1")  # decoder 0.75 and verifier 0.25 share one GPU
    (group,) = gpu1.groups
    with pytest.raises(ValueError, match="pods have 2 GPUs"):
        dataclasses.replace(gpu1, groups=(dataclasses.replace(group, gpus=2),))
