"""The one place that converts lane messages to and from protobuf.

Round trips are exact: floats travel as doubles (Python floats are doubles), top-logprob
order is kept, and ``None`` logprobs stay ``None``; ``tests/test_remote_verifier.py``
checks ``decode(encode(x)) == x``.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import cast

import torch

from detserve.config import SamplerConfig
from detserve.executor.runner import ModelRunner
from detserve.lane import LaneDecision, LanePass, LaneResult, LaneSegment
from detserve.numerics import LaneNumerics
from detserve.outputs import TokenLogprob
from detserve.params import SamplingSpec
from services.registry import DecoderRecord
from services.verifier import verifier_pb2 as pb


def kernels_profile(runner: ModelRunner) -> str:
    """What lane bits depend on besides weights, dtype and ``LaneNumerics``: the runner's
    kernel set (with its probes' verdicts), torch and the device kind. A verifier serves a
    decoder only if both runners report the same string (CPU GEMMs may split work by
    thread, so the thread count is part of it). ``ModelRunner.lane_kernels``: with the
    TP-invariant lane a TP decoder and its TP=1 verifier agree."""
    kernels = runner.lane_kernels
    if runner.device.type == "cuda":
        kind = torch.cuda.get_device_name(runner.device)
    else:
        kind = f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"
    return f"{kernels}/torch-{torch.__version__}/{kind}"


# ---- hello --------------------------------------------------------------------------
def encode_hello(record: DecoderRecord, transfer: pb.KVTransfer | None = None
                 ) -> pb.LaneRequest:
    """``transfer``: ask for K/V transfer (the verifier cannot map the pool)."""
    hello = pb.Hello(
        decoder_id=record.decoder_id, epoch=record.epoch,
        kv_handle=record.kv_handle.to_json(), weights_hash=record.weights_hash,
        dtype=record.kv_handle.dtype, numerics=encode_numerics(record.numerics),
        kernels=record.kernels)
    if transfer is not None:
        hello.transfer.CopyFrom(transfer)
    return pb.LaneRequest(hello=hello)


def encode_numerics(n: LaneNumerics) -> pb.LaneNumerics:
    """Every field, by name (``tests/test_remote_verifier.py`` checks that the message
    and the dataclass name the same fields)."""
    scalars = {f.name: getattr(n, f.name) for f in fields(n) if f.name != "sampling"}
    return pb.LaneNumerics(**scalars, sampling=pb.SamplerConfig(**asdict(n.sampling)))


def decode_numerics(m: pb.LaneNumerics) -> LaneNumerics:
    """Raises ValueError for numerics no runner can be built from."""
    scalars = {f.name: getattr(m, f.name) for f in fields(LaneNumerics) if f.name != "sampling"}
    sampling = SamplerConfig(**{f.name: getattr(m.sampling, f.name)
                                for f in fields(SamplerConfig)})
    return LaneNumerics(**scalars, sampling=sampling)


# ---- passes -------------------------------------------------------------------------
def _encode_spec(s: SamplingSpec) -> pb.SamplingSpec:
    return pb.SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                           seed=s.seed, logprobs=s.logprobs, min_tokens=s.min_tokens,
                           prompt_len=s.prompt_len, stop_ids=list(s.stop_ids),
                           bias_ids=[t for t, _ in s.logit_bias],
                           bias_values=[b for _, b in s.logit_bias],
                           presence_penalty=s.presence_penalty,
                           frequency_penalty=s.frequency_penalty)


def _decode_spec(s: pb.SamplingSpec) -> SamplingSpec:
    return SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                        logprobs=s.logprobs if s.HasField("logprobs") else None,
                        min_tokens=s.min_tokens, prompt_len=s.prompt_len,
                        stop_ids=tuple(s.stop_ids),
                        logit_bias=tuple(zip(s.bias_ids, s.bias_values, strict=True)),
                        presence_penalty=s.presence_penalty,
                        frequency_penalty=s.frequency_penalty)


def encode_pass(p: LanePass, kv_from: Mapping[int, int] | None = None) -> pb.LaneRequest:
    """``kv_from``: segment index -> first pushed row (K/V transfer)."""
    kv_from = kv_from or {}
    segs = [pb.LaneSegment(request_id=s.request_id, is_window=s.kind == "window", start=s.start,
                           input_ids=s.input_ids, block_table=s.block_table,
                           candidates=s.candidates, sample_rows=s.sample_rows,
                           spec=_encode_spec(s.spec), history=s.history,
                           prompt_logprobs=s.prompt_logprobs, prompt_targets=s.prompt_targets,
                           kv_from=kv_from.get(i))
            for i, s in enumerate(p.segments)]
    return pb.LaneRequest(lane_pass=pb.LanePass(pass_id=p.pass_id, rows=p.rows, segments=segs))


def decode_pass(p: pb.LanePass) -> LanePass:
    segs = tuple(LaneSegment(s.request_id, "window" if s.is_window else "prefill", s.start,
                             tuple(s.input_ids), tuple(s.block_table), tuple(s.candidates),
                             tuple(s.sample_rows), _decode_spec(s.spec), tuple(s.history),
                             s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
                             tuple(s.prompt_targets))
                 for s in p.segments)
    return LanePass(p.pass_id, p.rows, segs)


def decode_kv_from(p: pb.LanePass) -> list[int | None]:
    """Each segment's first pushed row, None where nothing is pushed. Raises ValueError
    for a range that is not within 0 .. start."""
    out: list[int | None] = []
    for s in p.segments:
        if not s.HasField("kv_from"):
            out.append(None)
        elif not 0 <= s.kv_from < s.start:
            raise ValueError(f"kv_from {s.kv_from} outside 0 .. {s.start}")
        else:
            out.append(s.kv_from)
    return out


# ---- results ------------------------------------------------------------------------
def _encode_logprob(lp: TokenLogprob | None) -> pb.Logprob:
    if lp is None:
        return pb.Logprob(present=False)
    return pb.Logprob(present=True, token_id=lp.token_id, logprob=lp.logprob,
                      top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()])


def _decode_logprob(lp: pb.Logprob) -> TokenLogprob | None:
    if not lp.present:
        return None
    return TokenLogprob(lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top})


def encode_result(r: LaneResult, kv_rows: int = 0) -> pb.LaneReply:
    decisions = [pb.LaneDecision(request_id=d.request_id, is_window=d.kind == "window",
                                 start=d.start, accepted=d.accepted, tokens=d.tokens,
                                 logprobs=[_encode_logprob(lp) for lp in d.logprobs],
                                 prompt_logprobs=[_encode_logprob(lp)
                                                  for lp in d.prompt_logprobs])
                 for d in r.decisions]
    return pb.LaneReply(decisions=pb.LaneResult(pass_id=r.pass_id, decisions=decisions,
                                                padding_rows=r.padding_rows,
                                                elapsed_s=r.elapsed_s, kv_rows=kv_rows))


def decode_result(r: pb.LaneResult) -> LaneResult:
    decisions = tuple(LaneDecision(d.request_id, "window" if d.is_window else "prefill",
                                   d.start, d.accepted, tuple(d.tokens),
                                   tuple(_decode_logprob(lp) for lp in d.logprobs),
                                   tuple(cast(TokenLogprob, _decode_logprob(lp))
                                         for lp in d.prompt_logprobs))
                      for d in r.decisions)
    return LaneResult(r.pass_id, decisions, r.padding_rows, r.elapsed_s)
