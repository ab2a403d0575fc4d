"""/health is readiness, /livez liveness: with requests failing (no decoder ready, Redis or
the verifier away) /health answers 503 with the reason while /livez answers 200; with
requests succeeding both answer 200. The served versions: test_serving_redis.py (an
outage) and test_serving_fuzz.py (after fuzzing)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from services.router.errors import APIError, unavailable
from services.router.http_app import build_http_app


class StubHealth:
    def __init__(self, refusal: APIError | None) -> None:
        self.refusal = refusal
        self.decoders_ready = 0 if refusal else 1

    async def status(self) -> APIError | None:
        return self.refusal


def _client(refusal: APIError | None) -> TestClient:
    return TestClient(build_http_app(SimpleNamespace(health=StubHealth(refusal))))  # type: ignore[arg-type]


def test_not_ready_but_alive() -> None:
    client = _client(unavailable("no decoder is ready (redis gone)"))
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unavailable"
    assert "no decoder is ready" in health.json()["error"]["message"]
    live = client.get("/livez")
    assert live.status_code == 200 and live.json() == {"status": "alive"}


def test_ready_and_alive() -> None:
    client = _client(None)
    assert client.get("/health").json() == {"status": "ok", "decoders_ready": 1}
    assert client.get("/livez").status_code == 200


def test_the_k8s_probes_ask_these_routes() -> None:
    from deploy.k8s.manifests import LIVENESS_PATH, READINESS_PATH

    client = _client(unavailable("no decoder is ready"))
    assert client.get(READINESS_PATH).status_code == 503
    assert client.get(LIVENESS_PATH).status_code == 200
