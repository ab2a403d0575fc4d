"""A deployment that fails to start: ``detserve serve``'s error says what its replica hit,
not only that the application failed (real Ray Serve)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


@pytest.fixture
def local_serve() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        serve.start()
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_failed_deployment_names_its_replicas_error(local_serve: None) -> None:
    from services.cli import run_app

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Broken:
        def __init__(self) -> None:
            raise ValueError("no weights at /nowhere/model.gguf")

    with pytest.raises(RuntimeError) as err:
        run_app(Broken.bind(), name="broken", route_prefix=None)
    text = str(err.value)
    assert "Broken" in text and "no weights at /nowhere/model.gguf" in text
