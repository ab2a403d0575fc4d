"""Requests over the decoders' links against a real cluster, from the moment it is up.

The first requests arrive while the router may not have attached a link yet (it reads
them from Redis every second): they wait for one instead of failing. Short requests one
after another and a concurrent burst all complete, every sequence over a link (the only
transport: no Ray Serve handle call carries a request), and deterministic ones equal the
offline engine's ``lane_only`` output."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from serving_cluster import MAX_MODEL_LEN, Cluster, G, W, serving_cluster

from detserve.llm import LLM
from detserve.params import SamplingParams

pytestmark = pytest.mark.timeout(600)
C = "/v1/completions"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with serving_cluster(num_decoders=2, num_verifiers=1) as c:
        yield c


def _body(cluster: Cluster, prompt: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": cluster.args["model"], "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **kw}


def _dispatched(cluster: Cluster, path: str) -> float:
    text = httpx.get(cluster.http_url + "/metrics").text
    prefix = f'detserve:router_dispatch_total{{path="{path}"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def test_short_requests_complete_over_links_from_start_up(cluster: Cluster) -> None:
    """One- to three-token requests, one after another (the first sent as soon as the
    cluster is up), then a concurrent burst: every one answers."""
    with httpx.Client(base_url=cluster.http_url, timeout=30) as http:
        for i in range(8):
            resp = http.post(C, json=_body(cluster, f"short {i}", 1 + i % 3))
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 1 + i % 3

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=30) as client:
            return list(await asyncio.gather(*(
                client.post(C, json=_body(cluster, f"burst {i}", 1 + i % 4)) for i in range(12))))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 12
    assert _dispatched(cluster, "link") >= 20 and _dispatched(cluster, "handle") == 0


def test_deterministic_streams_over_links_equal_offline(cluster: Cluster) -> None:
    prompts = (("Replay me", 2), ("A longer one", 19))
    llm = LLM(cluster.args["model"], mode="lane_only", verify_window=W, verify_group=G,
              max_model_len=MAX_MODEL_LEN)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a decoder replica runs
    try:
        refs = [llm.generate([p], SamplingParams(max_tokens=n, ignore_eos=True,
                                                 is_deterministic=True))[0]
                for p, n in prompts]
    finally:
        torch.set_num_threads(threads)
    with httpx.Client(base_url=cluster.http_url, timeout=60) as http:
        for (prompt, max_tokens), ref in zip(prompts, refs, strict=True):
            body = _body(cluster, prompt, max_tokens, is_deterministic=True, stream=True)
            ids: list[int] = []
            with http.stream("POST", C, json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        ids += [t for c in json.loads(line[6:])["choices"]
                                for t in c["token_ids"]]
            assert ids == list(ref.token_ids)
