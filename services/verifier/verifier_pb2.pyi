# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplerConfig(_message.Message):
    __slots__ = ("gumbel_chunk_rows", "gumbel_kernel", "logprob_kernel")
    GUMBEL_CHUNK_ROWS_FIELD_NUMBER: _ClassVar[int]
    GUMBEL_KERNEL_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_KERNEL_FIELD_NUMBER: _ClassVar[int]
    gumbel_chunk_rows: int
    gumbel_kernel: bool
    logprob_kernel: bool
    def __init__(self, gumbel_chunk_rows: _Optional[int] = ..., gumbel_kernel: _Optional[bool] = ..., logprob_kernel: _Optional[bool] = ...) -> None: ...

class LaneNumerics(_message.Message):
    __slots__ = ("verify_window", "verify_group", "block_size", "batch_invariant_rows", "lane_gemm_rows", "lane_one_calls", "lane_dot_sums", "lane_full_tiles", "aligned_decode_lane", "fused_silu_mul", "fused_add_rmsnorm", "sampling", "tensor_parallel_size", "tp_invariant_lane", "portable_products")
    VERIFY_WINDOW_FIELD_NUMBER: _ClassVar[int]
    VERIFY_GROUP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_ROWS_FIELD_NUMBER: _ClassVar[int]
    LANE_GEMM_ROWS_FIELD_NUMBER: _ClassVar[int]
    LANE_ONE_CALLS_FIELD_NUMBER: _ClassVar[int]
    LANE_DOT_SUMS_FIELD_NUMBER: _ClassVar[int]
    LANE_FULL_TILES_FIELD_NUMBER: _ClassVar[int]
    ALIGNED_DECODE_LANE_FIELD_NUMBER: _ClassVar[int]
    FUSED_SILU_MUL_FIELD_NUMBER: _ClassVar[int]
    FUSED_ADD_RMSNORM_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_INVARIANT_LANE_FIELD_NUMBER: _ClassVar[int]
    PORTABLE_PRODUCTS_FIELD_NUMBER: _ClassVar[int]
    verify_window: int
    verify_group: int
    block_size: int
    batch_invariant_rows: int
    lane_gemm_rows: int
    lane_one_calls: bool
    lane_dot_sums: bool
    lane_full_tiles: bool
    aligned_decode_lane: str
    fused_silu_mul: bool
    fused_add_rmsnorm: bool
    sampling: SamplerConfig
    tensor_parallel_size: int
    tp_invariant_lane: bool
    portable_products: bool
    def __init__(self, verify_window: _Optional[int] = ..., verify_group: _Optional[int] = ..., block_size: _Optional[int] = ..., batch_invariant_rows: _Optional[int] = ..., lane_gemm_rows: _Optional[int] = ..., lane_one_calls: _Optional[bool] = ..., lane_dot_sums: _Optional[bool] = ..., lane_full_tiles: _Optional[bool] = ..., aligned_decode_lane: _Optional[str] = ..., fused_silu_mul: _Optional[bool] = ..., fused_add_rmsnorm: _Optional[bool] = ..., sampling: _Optional[_Union[SamplerConfig, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ..., tp_invariant_lane: _Optional[bool] = ..., portable_products: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("decoder_id", "epoch", "kv_handle", "weights_hash", "dtype", "numerics", "kernels", "transfer")
    DECODER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    decoder_id: str
    epoch: int
    kv_handle: str
    weights_hash: str
    dtype: str
    numerics: LaneNumerics
    kernels: str
    transfer: KVTransfer
    def __init__(self, decoder_id: _Optional[str] = ..., epoch: _Optional[int] = ..., kv_handle: _Optional[str] = ..., weights_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., numerics: _Optional[_Union[LaneNumerics, _Mapping]] = ..., kernels: _Optional[str] = ..., transfer: _Optional[_Union[KVTransfer, _Mapping]] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("group", "backend", "device")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    group: str
    backend: str
    device: str
    def __init__(self, group: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SamplingSpec(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "min_tokens", "prompt_len", "stop_ids", "bias_ids", "bias_values", "presence_penalty", "frequency_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    min_tokens: int
    prompt_len: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    bias_ids: _containers.RepeatedScalarFieldContainer[int]
    bias_values: _containers.RepeatedScalarFieldContainer[float]
    presence_penalty: float
    frequency_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., prompt_len: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., bias_ids: _Optional[_Iterable[int]] = ..., bias_values: _Optional[_Iterable[float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ...) -> None: ...

class LaneSegment(_message.Message):
    __slots__ = ("request_id", "is_window", "start", "input_ids", "block_table", "candidates", "sample_rows", "spec", "history", "prompt_logprobs", "prompt_targets", "kv_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IS_WINDOW_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TARGETS_FIELD_NUMBER: _ClassVar[int]
    KV_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    is_window: bool
    start: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    block_table: _containers.RepeatedScalarFieldContainer[int]
    candidates: _containers.RepeatedScalarFieldContainer[int]
    sample_rows: _containers.RepeatedScalarFieldContainer[int]
    spec: SamplingSpec
    history: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    prompt_targets: _containers.RepeatedScalarFieldContainer[int]
    kv_from: int
    def __init__(self, request_id: _Optional[str] = ..., is_window: _Optional[bool] = ..., start: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., block_table: _Optional[_Iterable[int]] = ..., candidates: _Optional[_Iterable[int]] = ..., sample_rows: _Optional[_Iterable[int]] = ..., spec: _Optional[_Union[SamplingSpec, _Mapping]] = ..., history: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., prompt_targets: _Optional[_Iterable[int]] = ..., kv_from: _Optional[int] = ...) -> None: ...

class LanePass(_message.Message):
    __slots__ = ("pass_id", "rows", "segments")
    PASS_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    pass_id: int
    rows: int
    segments: _containers.RepeatedCompositeFieldContainer[LaneSegment]
    def __init__(self, pass_id: _Optional[int] = ..., rows: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[LaneSegment, _Mapping]]] = ...) -> None: ...

class LaneRequest(_message.Message):
    __slots__ = ("hello", "lane_pass", "release")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    LANE_PASS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    lane_pass: LanePass
    release: Release
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., lane_pass: _Optional[_Union[LanePass, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("present", "token_id", "logprob", "top")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    present: bool
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, present: _Optional[bool] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class LaneDecision(_message.Message):
    __slots__ = ("request_id", "is_window", "start", "accepted", "tokens", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IS_WINDOW_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    is_window: bool
    start: int
    accepted: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, request_id: _Optional[str] = ..., is_window: _Optional[bool] = ..., start: _Optional[int] = ..., accepted: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class LaneResult(_message.Message):
    __slots__ = ("pass_id", "decisions", "padding_rows", "elapsed_s", "kv_rows")
    PASS_ID_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    PADDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    KV_ROWS_FIELD_NUMBER: _ClassVar[int]
    pass_id: int
    decisions: _containers.RepeatedCompositeFieldContainer[LaneDecision]
    padding_rows: int
    elapsed_s: float
    kv_rows: int
    def __init__(self, pass_id: _Optional[int] = ..., decisions: _Optional[_Iterable[_Union[LaneDecision, _Mapping]]] = ..., padding_rows: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., kv_rows: _Optional[int] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("verifier_id",)
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    verifier_id: str
    def __init__(self, verifier_id: _Optional[str] = ...) -> None: ...

class PassError(_message.Message):
    __slots__ = ("pass_id", "message")
    PASS_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    pass_id: int
    message: str
    def __init__(self, pass_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class LaneReply(_message.Message):
    __slots__ = ("ready", "decisions", "error")
    READY_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ready: Ready
    decisions: LaneResult
    error: PassError
    def __init__(self, ready: _Optional[_Union[Ready, _Mapping]] = ..., decisions: _Optional[_Union[LaneResult, _Mapping]] = ..., error: _Optional[_Union[PassError, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("serving", "verifier_id", "weights_hash", "streams", "passes", "kv_bytes_in", "kv_bytes_out", "busy_s", "kv_blocks_used")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    verifier_id: str
    weights_hash: str
    streams: int
    passes: int
    kv_bytes_in: int
    kv_bytes_out: int
    busy_s: float
    kv_blocks_used: int
    def __init__(self, serving: _Optional[bool] = ..., verifier_id: _Optional[str] = ..., weights_hash: _Optional[str] = ..., streams: _Optional[int] = ..., passes: _Optional[int] = ..., kv_bytes_in: _Optional[int] = ..., kv_bytes_out: _Optional[int] = ..., busy_s: _Optional[float] = ..., kv_blocks_used: _Optional[int] = ...) -> None: ...
