"""``detserve serve --tensor-parallel-size 2 --tp-invariant-lane --dedicated-verifiers
--num-verifiers 1`` on CPU: a decoder replica whose engine spans two ranks (a spawned
worker, gloo) and one verifier replica registered as another host, with a KV pool of its
own; the lane's K/V moves between them by transfer (rows pushed and pulled over gloo,
gathered from and written to both ranks), never by mapping. The verifier replica runs
at TP=1, then at TP=2 itself (``--verifier-tensor-parallel-size 2``).

A deterministic, seeded request served over the OpenAI HTTP API with the fast path
perturbed gives the offline TP=1 ``lane_only`` tokens and logprobs bit for bit, and the
same again when served a second time; the verifier replica reports the passes it ran and
the rows the decoder pulled back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving_cluster import Cluster, serving_cluster, tp1_lane_reference

from detserve.parallel.layout import TREE_LAYOUT
from services.serve_config import APP_NAME, DECODER, VERIFIER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT, MAX_TOKENS = "A verifier of its own checks both ranks", 24


@pytest.fixture(scope="module", params=[1, 2], ids=["verifier-tp1", "verifier-tp2"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The verifier replica at TP=1, or itself at TP=2 (a worker of its own, its pool
    sharded: ``--verifier-tensor-parallel-size 2``)."""
    with serving_cluster(num_decoders=1, num_verifiers=1, dedicated_verifiers=True,
                         tensor_parallel_size=2, tp_invariant_lane=True,
                         verifier_tensor_parallel_size=request.param,
                         fastpath_perturbation=0.2) as c:
        yield c


def _handle_call(deployment: str, method: str) -> Any:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=APP_NAME)
    return getattr(handle, method).remote().result(timeout_s=30)


def test_tp2_decoder_verified_by_a_dedicated_replica(cluster: Cluster) -> None:
    ref = tp1_lane_reference(cluster.args["model"], PROMPT, MAX_TOKENS)
    body = {"model": cluster.args["model"], "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0.8, "seed": 5, "logprobs": 1, "ignore_eos": True,
            "is_deterministic": True}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        served = [client.post("/completions", json=body) for _ in range(2)]
    for resp in served:
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == ref.token_ids, "differs from the TP=1 lane_only oracle"
        assert choice["logprobs"]["token_logprobs"] == [lp.logprob for lp in ref.logprobs or ()]
        profile = resp.json()["determinism"]
        assert profile["tp_size"] == 2 and profile.get("tp_invariant_lane") == TREE_LAYOUT

    stats = _handle_call(DECODER, "stats")
    assert stats.verifier == "RemoteVerifier", "the lane left the decoder's ranks"
    assert stats.engine["perturbed_tokens"] > 0, "the fast path gave the lane work to catch"
    info = _handle_call(VERIFIER, "info")
    assert info["passes"] > 0, info
    # transferred, not mapped: the committed rows went back to the decoder's ranks
    assert info["kv_rows_out"] > 0 and info["kv_bytes_out"] > 0, info
