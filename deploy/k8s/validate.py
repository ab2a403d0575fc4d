"""Offline schema validation of rendered manifests.

- Core kinds: `kubernetes-validate` (the upstream OpenAPI schemas) in strict mode, which
  rejects unknown fields, for Kubernetes `K8S_VERSION`.
- KubeRay kinds: the CRDs in `crds/` (copied from KubeRay, Apache-2.0). Each CRD's
  `openAPIV3Schema` is turned into a JSON schema with the API server's structural rules:
  an object schema without `x-kubernetes-preserve-unknown-fields` admits only its listed
  properties (the server would prune the rest, and `kubectl apply` with server-side field
  validation rejects them), `nullable` admits null, `x-kubernetes-int-or-string` admits
  both. The root `metadata` is checked as a real ObjectMeta; the embedded pod templates
  are also checked as core PodTemplates, and a RayService's `rayClusterConfig` also
  against the RayCluster CRD. CEL rules (`x-kubernetes-validations`) are not evaluated.

    python -m deploy.k8s.validate deploy/k8s/overlays/gpu-8   # render, validate, policy
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from deploy.k8s.policy import check_policies, pod_templates
from deploy.k8s.render import render

K8S_VERSION = "1.30.0"
CRD_DIR = Path(__file__).resolve().parent / "crds"
CRD_FILES = {
    ("ray.io", "RayService"): "ray.io_rayservices.yaml",
    ("ray.io", "RayCluster"): "ray.io_rayclusters.yaml",
}
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# OpenAPI keywords with no JSON-schema meaning that the conversion drops.
_DROPPED = ("nullable", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
            "x-kubernetes-embedded-resource", "x-kubernetes-list-type",
            "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-validations")


def openapi_to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """Convert one structural OpenAPI v3 schema (a CRD version's schema) to JSON schema."""
    out = {k: v for k, v in node.items() if k not in _DROPPED}
    if "properties" in node:
        out["properties"] = {k: openapi_to_jsonschema(v) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = openapi_to_jsonschema(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        out["items"] = openapi_to_jsonschema(node["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            out[key] = [openapi_to_jsonschema(s) for s in node[key]]
    if "not" in node:
        out["not"] = openapi_to_jsonschema(node["not"])
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    is_object = node.get("type") == "object"
    if (is_object and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False  # unknown fields are pruned, i.e. rejected
    return out


@functools.cache
def crd_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    """JSON schema of `kind` at `version` from the CRD copy in `crds/` (root metadata free)."""
    try:
        filename = CRD_FILES[(group, kind)]
    except KeyError:
        raise KeyError(f"no CRD for {group}/{kind} in {CRD_DIR}") from None
    crd = yaml.load((CRD_DIR / filename).read_text(), Loader=_Loader)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            if not v.get("served", False):
                raise ValueError(f"{group}/{version} {kind} is not served")
            schema = openapi_to_jsonschema(v["schema"]["openAPIV3Schema"])
            # The root metadata is an ObjectMeta, which the API server validates itself
            # (see _metadata_errors); the CRD only says `type: object`.
            schema["properties"]["metadata"] = {"type": "object"}
            return schema
    raise KeyError(f"{CRD_DIR / filename} has no version {version}")


def _format_error(where: str, error: jsonschema.ValidationError) -> str:
    path = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{where}: {path}: {error.message}"


def _core_errors(obj: dict[str, Any], where: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [_format_error(where, error)]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{where}: {error.message}"]
    return []


def _metadata_errors(obj: dict[str, Any], where: str) -> list[str]:
    # Check the ObjectMeta against the upstream schema by wrapping it into the smallest
    # core object that has nothing else required.
    probe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}
    return _core_errors(probe, f"{where} metadata")


def _crd_errors(obj: dict[str, Any], where: str) -> list[str]:
    group, _, version = obj["apiVersion"].rpartition("/")
    schema = crd_schema(group, obj["kind"], version)
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [_format_error(where, e) for e in errors] + _metadata_errors(obj, where)


def validate_object(obj: dict[str, Any]) -> list[str]:
    """Every schema error of one object, as 'Kind/name: path: message' lines."""
    where = f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"
    group = obj.get("apiVersion", "").rpartition("/")[0]
    if group != "ray.io":
        return _core_errors(obj, where)
    errors = _crd_errors(obj, where)
    if obj["kind"] == "RayService" and "rayClusterConfig" in obj.get("spec", {}):
        cluster = {
            "apiVersion": obj["apiVersion"],
            "kind": "RayCluster",
            "metadata": {"name": obj["metadata"].get("name", "embedded")},
            "spec": copy.deepcopy(obj["spec"]["rayClusterConfig"]),
        }
        errors += _crd_errors(cluster, f"{where} rayClusterConfig as RayCluster")
    for name, template in pod_templates(obj):
        probe = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "probe"},
            "template": template,
        }
        errors += _core_errors(probe, f"{where} {name} pod template")
    return errors


def validate_objects(objects: list[dict[str, Any]]) -> list[str]:
    return [e for obj in objects for e in validate_object(obj)]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m deploy.k8s.validate KUSTOMIZATION_DIR...", file=sys.stderr)
        return 2
    failed = False
    for directory in args:
        objects = render(directory)
        problems = validate_objects(objects) + check_policies(objects)
        for line in problems:
            print(f"{directory}: {line}")
        print(f"{directory}: {len(objects)} objects, {len(problems)} problems")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
