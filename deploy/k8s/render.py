"""Render a kustomization without kustomize: the subset that deploy/k8s uses.

Supported: `resources` entries that are YAML files inside the kustomization's directory
(kustomize's default load restriction) or directories holding a kustomization of their
own; multi-document files; kustomize's refusal of two objects with the same id. Anything
else in a kustomization.yaml (patches, generators, namePrefix, labels, ...) raises
`UnsupportedKustomization` instead of being silently ignored, so this renderer cannot
drift from what `kubectl apply -k` does. Output order is traversal order (kustomize sorts
by kind; the objects are the same).

    python -m deploy.k8s.render deploy/k8s/overlays/gpu-8   # print the rendered YAML
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = frozenset({"apiVersion", "kind", "resources"})
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_NAMES:
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"no kustomization file in {directory}")


def load_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a file; each must be a Kubernetes object."""
    docs = [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= doc.keys():
            raise ValueError(f"{path}: every document needs apiVersion, kind and metadata")
    return docs


def object_id(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    """kustomize's resource id: (apiVersion group, kind, namespace, name)."""
    group = obj["apiVersion"].rpartition("/")[0]
    meta = obj["metadata"]
    return group, obj["kind"], meta.get("namespace", ""), meta["name"]


def render(directory: Path | str) -> list[dict[str, Any]]:
    """The objects of the kustomization in `directory`, as `kubectl kustomize` builds them."""
    objects = list(_render(Path(directory).resolve(), stack=()))
    seen: dict[tuple[str, str, str, str], int] = {}
    for index, obj in enumerate(objects):
        oid = object_id(obj)
        if oid in seen:
            raise ValueError(f"{directory}: object {oid} is defined twice")
        seen[oid] = index
    return objects


def _render(directory: Path, stack: tuple[Path, ...]) -> Iterator[dict[str, Any]]:
    if directory in stack:
        raise ValueError(f"kustomization cycle through {directory}")
    path = kustomization_file(directory)
    spec = yaml.load(path.read_text(), Loader=_Loader) or {}
    unsupported = sorted(set(spec) - SUPPORTED_KEYS)
    if unsupported:
        raise UnsupportedKustomization(
            f"{path}: {unsupported} not supported by deploy/k8s/render.py "
            f"(supported: {sorted(SUPPORTED_KEYS)})"
        )
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            yield from _render(target, stack + (directory,))
        elif target.is_file():
            if not target.is_relative_to(directory):
                raise ValueError(f"{path}: file {entry} is outside the kustomization root")
            yield from load_documents(target)
        else:
            raise FileNotFoundError(f"{path}: resource {entry} does not exist")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m deploy.k8s.render DIRECTORY", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(render(args[0]), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
