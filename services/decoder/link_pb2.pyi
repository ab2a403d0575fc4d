# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "is_deterministic", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "min_tokens", "has_logit_bias", "bias_ids", "bias_values", "presence_penalty", "frequency_penalty", "skip_special_tokens", "output_kind")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IS_DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_KIND_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    is_deterministic: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    min_tokens: int
    has_logit_bias: bool
    bias_ids: _containers.RepeatedScalarFieldContainer[int]
    bias_values: _containers.RepeatedScalarFieldContainer[float]
    presence_penalty: float
    frequency_penalty: float
    skip_special_tokens: bool
    output_kind: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., is_deterministic: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., has_logit_bias: _Optional[bool] = ..., bias_ids: _Optional[_Iterable[int]] = ..., bias_values: _Optional[_Iterable[float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., skip_special_tokens: _Optional[bool] = ..., output_kind: _Optional[str] = ...) -> None: ...

class Submit(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "accepted", "dispatched", "avoid")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_FIELD_NUMBER: _ClassVar[int]
    AVOID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: Sampling
    accepted: float
    dispatched: float
    avoid: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[Sampling, _Mapping]] = ..., accepted: _Optional[float] = ..., dispatched: _Optional[float] = ..., avoid: _Optional[_Iterable[str]] = ...) -> None: ...

class RouterFrame(_message.Message):
    __slots__ = ("submit", "abort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    submit: Submit
    abort: str
    def __init__(self, submit: _Optional[_Union[Submit, _Mapping]] = ..., abort: _Optional[str] = ...) -> None: ...

class RouterFrames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[RouterFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[RouterFrame, _Mapping]]] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: Logprob
    def __init__(self, value: _Optional[_Union[Logprob, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("request_id", "replica", "text", "token_ids", "has_logprobs", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_output_tokens", "determinism_json", "error", "error_type", "engine_stats", "has_prompt_logprobs", "prompt_logprobs")
    class EngineStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DETERMINISM_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    replica: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_logprobs: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprob]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    determinism_json: str
    error: str
    error_type: str
    engine_stats: _containers.ScalarMap[str, float]
    has_prompt_logprobs: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    def __init__(self, request_id: _Optional[str] = ..., replica: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., has_logprobs: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., determinism_json: _Optional[str] = ..., error: _Optional[str] = ..., error_type: _Optional[str] = ..., engine_stats: _Optional[_Mapping[str, float]] = ..., has_prompt_logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ...) -> None: ...

class DecoderChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ...) -> None: ...
