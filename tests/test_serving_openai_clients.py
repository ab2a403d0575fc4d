"""The unmodified ``openai`` client gets deterministic output without ``is_deterministic``:
through the model's deterministic name and through the ``X-Detserve-Deterministic``
header (``extra_headers``), streamed, with ``n > 1``, equal across concurrent repeats and
to the offline ``lane_only`` engine given the documented default seeds. gRPC clients get
the same through the model name and request metadata. A served cluster with fast-path
faults injected; the plain name's output shows them (the control)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest
import torch
from serving_cluster import MAX_MODEL_LEN, Cluster, G, W, serving_cluster

from detserve.llm import LLM
from detserve.params import SamplingParams
from services.router import detserve_pb2 as pb
from services.router import detserve_pb2_grpc as pb_grpc
from services.router.prepare import DEFAULT_SEED, DETERMINISM_HEADER

pytestmark = pytest.mark.timeout(600)
PROMPT = "A deterministic server returns the same tokens"
MESSAGES: list[Any] = [{"role": "user", "content": "Name a colour."}]
REPEATS = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with serving_cluster(num_decoders=1, num_verifiers=1, fastpath_perturbation=0.2) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def names(client: openai.OpenAI) -> tuple[str, str]:
    """(plain, deterministic) model names, as /v1/models lists them."""
    plain, exact = (m.id for m in client.models.list().data)
    return plain, exact


@pytest.fixture(scope="module")
def offline(cluster: Cluster) -> LLM:
    return LLM(cluster.args["model"], mode="lane_only", verify_window=W, verify_group=G,
               max_model_len=MAX_MODEL_LEN)


def reference(llm: LLM, **params: Any) -> list[int]:
    """Offline lane_only token ids of PROMPT, single-threaded like a decoder replica."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = llm.generate([PROMPT], SamplingParams(is_deterministic=True, **params))[0]
    finally:
        torch.set_num_threads(threads)
    return list(out.token_ids)


def streamed(stream: Any, n: int) -> tuple[list[list[int]], str | None]:
    """Each choice's token ids from a completion or chat stream; the fingerprint seen."""
    ids: list[list[int]] = [[] for _ in range(n)]
    fingerprint = None
    for chunk in stream:
        fingerprint = chunk.system_fingerprint or fingerprint
        for c in chunk.choices:
            ids[c.index] += (c.model_extra or {}).get("token_ids", [])
    return ids, fingerprint


def repeated(fn: Any) -> list[Any]:
    """``fn()`` REPEATS times at once."""
    with ThreadPoolExecutor(REPEATS) as pool:
        return list(pool.map(lambda _: fn(), range(REPEATS)))


def test_models_list_the_deterministic_name(names: tuple[str, str], cluster: Cluster) -> None:
    assert names == (cluster.args["model"], cluster.args["model"] + ":deterministic")


def test_deterministic_name_streams_n_choices(client: openai.OpenAI, names: tuple[str, str],
                                             offline: LLM) -> None:
    exact = names[1]
    refs = [reference(offline, max_tokens=16, temperature=1.0, seed=DEFAULT_SEED + i)
            for i in range(2)]
    assert refs[0] != refs[1]  # each choice samples with its own seed

    def call() -> tuple[list[list[int]], str | None]:
        return streamed(client.completions.create(model=exact, prompt=PROMPT, max_tokens=16,
                                                  temperature=1.0, n=2, stream=True), 2)

    results = repeated(call)
    for ids, fingerprint in results:
        assert ids == refs, "deterministic choices differ from the offline engine"
        assert fingerprint is not None and fingerprint == results[0][1]
    whole = client.completions.create(model=exact, prompt=PROMPT, max_tokens=16,
                                      temperature=1.0, n=2)
    assert [(c.model_extra or {})["token_ids"] for c in whole.choices] == refs
    assert whole.model == exact and whole.system_fingerprint == results[0][1]


def test_header_streams_n_chat_choices(client: openai.OpenAI, names: tuple[str, str]) -> None:
    plain, exact = names

    def chat(model: str, **kw: Any) -> tuple[list[list[int]], str | None]:
        return streamed(client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, n=2, stream=True,
            **kw), 2)

    results = repeated(lambda: chat(plain, extra_headers={DETERMINISM_HEADER: "true"}))
    ids, fingerprint = results[0]
    assert fingerprint is not None and ids[0] != ids[1]
    assert all(r == (ids, fingerprint) for r in results)
    assert chat(exact) == (ids, fingerprint)  # the same request through the name


def test_plain_name_shows_the_faults(client: openai.OpenAI, names: tuple[str, str],
                                     offline: LLM) -> None:
    """Control: greedy, through the plain name, the injected fast-path faults show; the
    same request through the header or the deterministic name equals the lane."""
    plain, exact = names
    ref = reference(offline, max_tokens=24, temperature=0.0)

    def greedy(model: str, **kw: Any) -> list[int]:
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=24,
                                           temperature=0, stream=True, **kw)
        return streamed(stream, 1)[0][0]

    assert repeated(lambda: greedy(exact)) == [ref] * REPEATS
    assert greedy(plain, extra_headers={DETERMINISM_HEADER: "1"}) == ref
    differing = sum(ids != ref for ids in repeated(lambda: greedy(plain)))
    assert differing >= REPEATS // 2, f"only {differing}/{REPEATS} fast-path outputs changed"


def test_grpc_name_and_metadata(cluster: Cluster, client: openai.OpenAI,
                                names: tuple[str, str]) -> None:
    plain, exact = names
    http = client.completions.create(model=exact, prompt=PROMPT, max_tokens=12, temperature=0)
    want = (http.choices[0].model_extra or {})["token_ids"]
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        for model, metadata in ((exact, ()), (plain, ((DETERMINISM_HEADER.lower(), "true"),))):
            req = pb.GenerateRequest(prompt=PROMPT, max_tokens=12, temperature=0.0, model=model)
            events = list(stub.Generate(req, metadata=metadata))
            done = events[-1].complete
            assert done.is_deterministic, model
            assert done.determinism.fingerprint == http.system_fingerprint
            assert [t for e in events[:-1] for t in e.chunk.token_ids] == want
        req = pb.GenerateRequest(prompt=PROMPT, max_tokens=2, model=exact, is_deterministic=False)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
