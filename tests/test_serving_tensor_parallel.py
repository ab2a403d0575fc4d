"""``detserve serve --tensor-parallel-size 2 --tp-invariant-lane`` on CPU: a decoder
replica whose engine spans two ranks (a spawned worker process, gloo), the lane on those
ranks. A deterministic request's tokens and logprobs, served with the fast path perturbed,
equal the offline engine's ``lane_only`` at TP=1 bit for bit; a non-deterministic one is
served too."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serving_cluster import Cluster, serving_cluster, tp1_lane_reference

from detserve.parallel.layout import TREE_LAYOUT
from services.serve_config import default_serve_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT, MAX_TOKENS = "Tensor parallel ranks agree on every bit", 24


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with serving_cluster(num_decoders=1, num_verifiers=0, tensor_parallel_size=2,
                         tp_invariant_lane=True, fastpath_perturbation=0.2) as c:
        yield c


def test_tp2_serves_the_tp1_lane_bits(cluster: Cluster) -> None:
    ref = tp1_lane_reference(cluster.args["model"], PROMPT, MAX_TOKENS)
    body = {"model": cluster.args["model"], "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0.8, "seed": 5, "logprobs": 1, "ignore_eos": True}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        det = client.post("/completions", json={**body, "is_deterministic": True})
        other = client.post("/completions", json={**body, "is_deterministic": False})
    assert det.status_code == 200, det.text
    choice = det.json()["choices"][0]
    assert choice["token_ids"] == ref.token_ids
    assert choice["logprobs"]["token_logprobs"] == [lp.logprob for lp in ref.logprobs or ()]
    profile = det.json()["determinism"]
    assert profile["tp_size"] == 2 and profile.get("tp_invariant_lane") == TREE_LAYOUT
    assert other.status_code == 200, other.text
    assert len(other.json()["choices"][0]["token_ids"]) == MAX_TOKENS


def test_tp_serve_args_are_checked() -> None:
    with pytest.raises(ValueError, match="num_verifiers must be 0"):
        default_serve_config(tensor_parallel_size=2, num_verifiers=1)
    config = default_serve_config(tensor_parallel_size=2, num_verifiers=0)
    assert config["applications"][0]["args"]["tensor_parallel_size"] == 2
