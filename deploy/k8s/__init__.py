"""Kubernetes deployment of detserve: manifest generation, offline validation and policy.

- `manifests`: the overlays (cpu-demo, gpu-1, gpu-8) as Python data; builds each overlay's
  RayService and engine ConfigMap from `services.serve_config`.
- `generate`: writes (or checks) the generated files under `overlays/`.
- `render`: the subset of kustomize the overlays use, to render them without kustomize.
- `validate`: core kinds against the upstream Kubernetes schemas, KubeRay kinds against
  the CRD schemas in `crds/`, unknown fields rejected.
- `policy`: pinned images, resources on every container, no privileged containers,
  Redis isolated by a NetworkPolicy.
"""
