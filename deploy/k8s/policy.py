"""Deployment policy checks on rendered manifests (what schemas cannot say).

`check_policies(objects)` returns one line per violation, empty when all hold:
- every container image is pinned by a tag other than `latest` or by a sha256 digest;
- every container has CPU and memory requests and limits, and a GPU limit equal to its
  request (the autoscaler sidecar that KubeRay injects takes `autoscalerOptions.resources`);
- no container is privileged or may escalate privileges, none adds capabilities, and no
  pod shares the node's network, PID or IPC namespace;
- Redis is reachable only from inside its namespace: a NetworkPolicy with an Ingress
  policy selects its pods and admits only same-namespace pod selectors (no
  namespaceSelector, no ipBlock), its Services are ClusterIP, and no Ingress routes to them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})
REDIS_POD_LABELS = {"app.kubernetes.io/name": "detserve", "app.kubernetes.io/component": "redis"}
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def pod_templates(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, pod template) of a RayService or RayCluster's head and worker groups."""
    spec = obj.get("spec", {})
    cluster = spec.get("rayClusterConfig", {}) if obj["kind"] == "RayService" else spec
    head = cluster.get("headGroupSpec", {})
    if "template" in head:
        yield "head", head["template"]
    for group in cluster.get("workerGroupSpecs", []):
        if "template" in group:
            yield f"worker group {group.get('groupName', '?')}", group["template"]


def pod_specs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """(where, pod spec, pod labels) for every pod an object describes."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    spec = obj.get("spec", {})
    if kind in WORKLOAD_KINDS:
        template = spec.get("template", {})
        yield f"{kind}/{name}", template.get("spec", {}), template.get("metadata", {}).get(
            "labels", {})
    elif kind == "CronJob":
        template = spec.get("jobTemplate", {}).get("spec", {}).get("template", {})
        yield f"{kind}/{name}", template.get("spec", {}), template.get("metadata", {}).get(
            "labels", {})
    elif kind == "Pod":
        yield f"Pod/{name}", spec, obj["metadata"].get("labels", {})
    elif kind in ("RayService", "RayCluster"):
        for group, template in pod_templates(obj):
            yield f"{kind}/{name} {group}", template.get("spec", {}), template.get(
                "metadata", {}).get("labels", {})


def image_pinned(image: str) -> bool:
    if _DIGEST.search(image):
        return True
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return False
    tag = last.rsplit(":", 1)[1]
    return bool(tag) and tag != "latest"


def _resource_problems(where: str, resources: Mapping[str, Any]) -> list[str]:
    problems = []
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    for kind in ("cpu", "memory"):
        if kind not in requests:
            problems.append(f"{where}: no {kind} request")
        if kind not in limits:
            problems.append(f"{where}: no {kind} limit")
    for name, amount in limits.items():
        if name.endswith("/gpu") and str(requests.get(name)) != str(amount):
            problems.append(f"{where}: {name} request must equal its limit")
    return problems


def _container_problems(where: str, container: Mapping[str, Any]) -> list[str]:
    where = f"{where} container {container.get('name', '?')}"
    problems = []
    image = container.get("image", "")
    if not image_pinned(image):
        problems.append(f"{where}: image {image!r} is not pinned by tag or digest")
    problems += _resource_problems(where, container.get("resources", {}))
    problems += _security_problems(where, container.get("securityContext", {}))
    return problems


def _security_problems(where: str, security: Mapping[str, Any]) -> list[str]:
    problems = []
    if security.get("privileged"):
        problems.append(f"{where}: privileged")
    if security.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: allowPrivilegeEscalation must be false")
    if security.get("capabilities", {}).get("add"):
        problems.append(f"{where}: adds capabilities {security['capabilities']['add']}")
    return problems


def container_problems(obj: dict[str, Any]) -> list[str]:
    problems = []
    for where, spec, _ in pod_specs(obj):
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(key):
                problems.append(f"{where}: {key} is set")
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            problems += _container_problems(where, container)
    if obj["kind"] in ("RayService", "RayCluster"):
        spec = obj.get("spec", {})
        cluster = spec.get("rayClusterConfig", {}) if obj["kind"] == "RayService" else spec
        if cluster.get("enableInTreeAutoscaling"):
            options = cluster.get("autoscalerOptions", {})
            where = f"{obj['kind']}/{obj['metadata']['name']} autoscaler sidecar"
            problems += _resource_problems(where, options.get("resources", {}))
            problems += _security_problems(where, options.get("securityContext", {}))
            if "image" in options and not image_pinned(options["image"]):
                problems.append(f"{where}: image {options['image']!r} is not pinned")
    return problems


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def redis_problems(objects: list[dict[str, Any]]) -> list[str]:
    redis_pods = [
        labels for obj in objects for _, _, labels in pod_specs(obj)
        if _selects(REDIS_POD_LABELS, labels)
    ]
    if not redis_pods:
        return [f"no Redis workload found (pods labelled {REDIS_POD_LABELS})"]
    problems = []
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for labels in redis_pods:
        guarding = [
            p for p in policies
            if _selects(p["spec"].get("podSelector", {}).get("matchLabels", {}), labels)
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        ]
        if not guarding:
            problems.append("Redis pods are not selected by any Ingress NetworkPolicy")
        for policy in guarding:
            problems += _policy_peer_problems(policy)
    redis_services = {
        o["metadata"]["name"] for o in objects
        if o["kind"] == "Service"
        and any(_selects(o["spec"].get("selector", {}), labels) for labels in redis_pods)
    }
    for obj in objects:
        if obj["kind"] == "Service" and obj["metadata"]["name"] in redis_services:
            spec = obj["spec"]
            if spec.get("type", "ClusterIP") != "ClusterIP" or spec.get("externalIPs"):
                problems.append(f"Service/{obj['metadata']['name']}: Redis exposed outside "
                                "the cluster")
        if obj["kind"] == "Ingress":
            for backend in _ingress_backends(obj):
                if backend in redis_services:
                    problems.append(f"Ingress/{obj['metadata']['name']}: routes to Redis "
                                    f"Service {backend}")
    return problems


def _policy_peer_problems(policy: dict[str, Any]) -> list[str]:
    name = f"NetworkPolicy/{policy['metadata']['name']}"
    problems = []
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        if not peers:
            problems.append(f"{name}: an ingress rule without `from` admits every source")
        for peer in peers or []:
            if "namespaceSelector" in peer or "ipBlock" in peer:
                problems.append(f"{name}: admits sources outside the namespace ({peer})")
    return problems


def _ingress_backends(ingress: dict[str, Any]) -> Iterator[str]:
    spec = ingress.get("spec", {})
    default = spec.get("defaultBackend", {}).get("service", {}).get("name")
    if default:
        yield default
    for rule in spec.get("rules", []):
        for path in rule.get("http", {}).get("paths", []):
            name = path.get("backend", {}).get("service", {}).get("name")
            if name:
                yield name


def check_policies(objects: list[dict[str, Any]]) -> list[str]:
    problems = [p for obj in objects for p in container_problems(obj)]
    return problems + redis_problems(objects)
