"""Engine configuration: one frozen dataclass per component, validated on construction.

Every option is declared here once, as a field whose metadata carries its help text
(``opt(default, "help")``); ``detserve/flags.py`` turns the fields into command-line flags
(``--field-name``), so ``detserve generate``, ``detserve serve`` and the benchmarks share
names and defaults. Measurements behind the defaults are in docs/benchmarks/.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from detserve.kernels.config import TABLE, lane_variant  # (no triton: table and checks only)
from detserve.parallel.layout import INVARIANT_LEAVES  # (no torch)

MODES = ("llm42", "nondeterministic", "batch_invariant", "lane_only")
# lane_max_wait_steps by device: on a GPU a deterministic prompt does not wait for a pass
# to fill (measured: docs/benchmarks/gpu/2026-11-28-c-h100-h200x4, the campaign's TTFT)
LANE_WAIT_STEPS = {"cuda": 0, "cpu": 16}
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)  # what callers may ask for; ``EngineConfig.create`` resolves
# max_model_len when none is given: the model's positions, but no more than this. The KV
# cache is sized from max_model_len (``EngineConfig.create``), so a model with a long
# context (Llama-3.1: 131072 positions) would otherwise allocate a cache of many GiB by
# default; a longer context is asked for explicitly
DEFAULT_MAX_MODEL_LEN_CAP = 8192
log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
MODE_HELP = ("llm42 (decode-verify-rollback), nondeterministic, batch_invariant or "
             "lane_only (every deterministic token through the lane: the oracle)")


def opt(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with a default and its help text (``metadata["help"]``); further
    metadata: ``choices`` (the values validation accepts), ``short`` (a short flag)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults need a default_factory")
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "KV cache block size in tokens (a power of two)")
    num_blocks: int = opt(1024, "KV cache blocks; block 0 is the padding rows' scratch "
                                "block (EngineConfig.create: enough for a full lane of "
                                "max_model_len sequences when not given)")
    enable_prefix_caching: bool = opt(True, "share lane-computed prompt blocks between "
                                            "deterministic requests")

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2")

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


@dataclass(frozen=True)
class SamplerConfig:
    """How many rows ``launch_rows`` picks at once on CUDA (CPU goes row by row but for the
    greedy argmax). Every setting gives each row its row-by-row bits except
    ``logprob_kernel``, whose logprobs are that kernel's own (kernel set tag "+lpk")."""

    gumbel_chunk_rows: int = opt(
        64, "CUDA: sampled rows without top-p, logprobs, a stop mask or a logit bias are "
            "picked this many at a time (gumbel_rows) instead of one by one; 0: row by row")
    gumbel_kernel: bool = opt(True, "CUDA: those rows in one Triton pass (kernels.gumbel) "
                                    "instead of torch's kernels")
    logprob_kernel: bool = field(default=True, metadata={
        "help": "CUDA: rows asking for logprobs take the many-row paths too, their logprobs "
                "from one kernels.logprobs pass (a row's bits the same in any batch, the "
                "kernel's own, not log_softmax's)",
        "tag": {True: "+lpk"}})

    def __post_init__(self) -> None:
        if self.gumbel_chunk_rows < 0:
            raise ValueError("gumbel_chunk_rows must be >= 0 (0: row by row)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Bookkeeping limits plus the lane geometry.

    The lane (fixed-shape verification/prefill pass) always has exactly
    ``verify_window * verify_group`` rows. ``lane_only`` keeps that geometry but lets every
    deterministic token through the lane directly (window of one row), so its numerics
    equal those of ``llm42``'s lane: that is what makes it the test oracle.
    """

    mode: str = opt("llm42", MODE_HELP, choices=MODES)
    max_num_seqs: int = opt(64, "sequences a fast step carries at most")
    max_num_batched_tokens: int = opt(2048, "tokens a fast step carries at most")
    max_model_len: int = opt(2048, "longest sequence (prompt and output) in tokens")
    verify_window: int = opt(64, "W: rows of a verification window", short="-W")
    verify_group: int = opt(8, "G: windows per lane pass (a pass has W*G rows)", short="-G")
    lane_max_wait_steps: int | None = opt(
        None, "steps a lane pass waits to fill once work is ready for it (a deterministic "
              "prompt's first token waits as long); default: 0 on CUDA, where a pass runs "
              "only the row multiples it needs, 16 on CPU, where it runs its whole shape")
    overlap_windows: bool = opt(
        True, "while a window is in the lane, its sequence decodes the next window on the "
              "fast path (kept if the lane commits the whole window and agrees on its next "
              "token)")
    lane_bound_fraction: float = opt(
        0.2, "when more than this share of the running sequences wait on the lane and a "
             "pass is in flight, a step gives the GPU to that pass instead of decoding the "
             "few others (the lane and the fast path share the GPU); 1: never")
    lane_decode_in_mixed_steps: bool = opt(
        True, "deterministic sequences' decode rows join fast steps that also carry prefill "
              "rows (on CUDA their products then run as a padded call of their own); off: "
              "they sit out every other such step")
    pipeline_lane_prefill: bool = opt(
        True, "a long deterministic prompt sends its next chunk to the lane while the "
              "previous one is still there (passes run in order), instead of one lane round "
              "trip per chunk")
    decode_past_queued_windows: bool = opt(
        True, "a sequence whose full window waits for the pass to fill keeps decoding past "
              "it, and windows then wait until the pass is full or a sequence can decode no "
              "further (prompt chunks still wait at most lane_max_wait_steps)")
    prefill_batch_tokens: int | None = opt(
        None, "while others decode, new prompts wait (decode-only steps, graph replays) "
              "until this many of their tokens are pending or prefill_max_wait_steps passed; "
              "0: never wait; default: max_num_batched_tokens // 4 on CUDA, 0 on CPU")
    prefill_max_wait_steps: int = opt(8, "steps a new prompt waits at most for others "
                                         "(prefill_batch_tokens)")
    parked_seq_headroom: float = opt(
        0.125, "while deterministic sequences are parked on the lane (in no fast step), "
               "admit as many more, up to this share of max_num_seqs, so the fast batch "
               "stays full; 0: every running sequence holds a slot")
    lane_prefill_ahead: int = opt(
        8, "a lane pass's spare rows take the prompts of deterministic requests still "
           "queued, admitting them ahead while at most this many lane sequences wait for "
           "their prompt's lane prefill (no output changes); 0: off")
    lane_prefill_lookahead: int = opt(
        32, "lane_prefill_ahead takes prompts among the first this many queued requests: a "
            "deterministic request moves ahead of at most that many others (the queue's "
            "length or more is a priority policy for deterministic traffic)")
    lane_partial_windows: bool = opt(
        True, "a lane pass's spare rows verify the candidates so far of lane sequences in "
              "the middle of a window (the lane's verdict on a token does not depend on "
              "where its window starts, so no output changes)")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "verify_window", "verify_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("lane_max_wait_steps", "prefill_max_wait_steps"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.prefill_batch_tokens is not None and self.prefill_batch_tokens < 0:
            raise ValueError("prefill_batch_tokens must be >= 0 (None: chosen by device)")
        if not 0.0 <= self.lane_bound_fraction <= 1.0:
            raise ValueError("lane_bound_fraction must be in [0, 1]")
        if not 0.0 <= self.parked_seq_headroom <= 1.0:
            raise ValueError("parked_seq_headroom must be in [0, 1]")
        if isinstance(self.lane_prefill_ahead, bool) or not isinstance(self.lane_prefill_ahead, int) \
                or self.lane_prefill_ahead < 0:
            raise ValueError("lane_prefill_ahead must be an integer >= 0 (0: off)")
        if isinstance(self.lane_prefill_lookahead, bool) \
                or not isinstance(self.lane_prefill_lookahead, int) or self.lane_prefill_lookahead < 1:
            raise ValueError("lane_prefill_lookahead must be a positive integer")

    @property
    def lane_rows(self) -> int:
        return self.verify_window * self.verify_group

    @property
    def uses_lane(self) -> bool:
        return self.mode in ("llm42", "lane_only")

    @property
    def max_candidates(self) -> int:
        """Fast-path candidates per window: W-1 (the window also holds the last committed token)."""
        return 0 if self.mode == "lane_only" else self.verify_window - 1


# the options of the nested configs by name (``EngineConfig.create``; the mode is the
# engine's)
SCHEDULER_FIELDS = tuple(f.name for f in fields(SchedulerConfig) if f.name != "mode")
SAMPLER_FIELDS = tuple(f.name for f in fields(SamplerConfig))


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata={
        "help": "HF folder, .gguf file, 'smollm2' (fetched once) or random:<shape>",
        "cli_default": DEFAULT_MODEL})
    mode: str = opt("llm42", MODE_HELP, choices=MODES)
    device: str = opt("cpu", "cpu or cuda[:N]")
    dtype: str = opt("float32", "weights' and activations' dtype; auto (the flags' default, "
                     "resolved by EngineConfig.create): float32 on CPU, on CUDA the "
                     "checkpoint's bfloat16 or float16, else bfloat16",
                     choices=DTYPE_CHOICES, cli_default="auto")
    seed: int = opt(0, "the engine's seed (sampled requests without a seed of their own)")
    fastpath_perturbation: float = opt(
        0.0, "fault injection (tests): probability that a fast-path token is corrupted; the "
             "lane must catch every one")
    batch_invariant_rows: int = opt(32, "batch_invariant mode's fixed row chunk (CPU "
                                        "reference)")
    lane_threaded: bool = opt(False, "run lane passes on a worker thread (always on CUDA at "
                                     "TP=1; at TP>1 on CUDA the lane runs in the engine's "
                                     "thread)")
    lane_sms: int | None = opt(
        None, "CUDA: the lane runs in a green context of this many SMs (the verifier on "
              "dedicated SMs of the decoder's GPU); default: shared")
    cuda_graphs: bool = opt(True, "CUDA: graphs for decode batches and the lane pass")
    cuda_graph_max_batch: int = opt(256, "CUDA: largest decode batch captured (bigger ones "
                                         "run eagerly)")
    cuda_graph_step_rows: int = opt(
        2048, "CUDA: steps that carry prompt chunks of up to this many rows (capped by the "
              "token budget) replay graphs too; 0: they run eagerly")
    align_fast_path: bool = opt(
        True, "CUDA: the fast path computes what the lane computes wherever it can (decode "
              "rows on the lane's attention kernel, products padded into the lane chunk's "
              "cuBLAS class), so few windows roll back")
    lane_gemm_rows: int = opt(
        0, "the lane's product row chunk (a row's bits depend on it, not on the pass's "
           "other rows). CUDA, 0: chosen by probing cuBLAS (gemm_classes.plan_alignment); "
           "CPU: also the lane attention's chunk, 0: the whole W*G pass")
    portable_lane: bool = opt(
        False, "CUDA, align_fast_path: pick a lane chunk whose cuBLAS products give the "
               "Triton batch-invariant kernel's bits, so deterministic outputs are the same on "
               "every card of the device class (architecture, SM count, Triton), which the "
               "fingerprint then names; the fast path's decode rows or the lane's passes may "
               "be padded further; refused where no chunk qualifies")
    probe_single_calls: bool = opt(
        True, "CUDA, align_fast_path: probe at start-up which eager step sizes give the "
              "leading decode rows the lane chunk's bits in one call over all rows; those "
              "products then run unsplit")
    lane_one_calls: bool = opt(
        True, "CUDA: the lane runs a product as one call over several chunks' rows where a "
              "start-up probe found that call to give every row the chunk's bits (one "
              "weight read instead of several); off: chunk by chunk")
    lane_full_tiles: bool = opt(
        True, "CUDA: the lane attention kernel runs the KV tiles every slot sees whole "
              "without position masks (the same bits)")
    aligned_decode_lane: str = opt(
        "auto", "CUDA, aligned fast path: the lane kernel's query tile and launch for "
                "decode rows, BLOCK_M:NUM_WARPS:NUM_STAGES ('': the lane's own; auto: 16:2:3 "
                "with dot sums where a start-up probe finds it keeps the lane's bits at the "
                "model's GQA group, else the lane's own). A tile that misses them only makes "
                "windows roll back")
    lane_dot_sums: bool = opt(
        True, "CUDA: the lane kernel sums a row's probabilities over a tile as a matrix "
              "product with ones, so its bits do not depend on the query tile (decode rows "
              "then take a one-row kernel); off: tl.sum, other bits")
    fused_silu_mul: bool = opt(True, "CUDA: SiLU-and-multiply as one Triton kernel "
                                     "(torch's bits)")
    plain_decode_graphs: bool = opt(
        True, "CUDA, align_fast_path: decode steps with no row the lane will verify replay "
              "graphs of the plain fast path (split-KV, no padding), so the alignment costs "
              "only steps with a deterministic decode row")
    fused_add_rmsnorm: bool = opt(True, "CUDA: the residual add inside the RMSNorm's kernel "
                                        "(torch's bits)")
    async_scheduling: bool | None = opt(
        None, "plan and queue each step before reading the previous step's tokens, so the "
              "host's work overlaps the device's; default: on for CUDA, off on CPU")
    tensor_parallel_size: int = opt(
        1, "ranks the model's heads, MLP and vocabulary are split over (a power of two): "
           "rank 0 runs the engine, ranks 1.. are worker processes (gloo on CPU; on CUDA, "
           "NCCL, rank r on the device r places after the engine's)")
    tp_invariant_lane: bool = opt(
        False, "lane passes reduce the row-parallel products (o_proj, down_proj) in a fixed "
               "tree whose top levels are the TP split, so deterministic requests get the "
               f"same bits at every TP size dividing {INVARIANT_LEAVES} (the fingerprint then "
               "omits the TP size); the fast path keeps the plain all-reduce")
    tp_peer_sums: bool = opt(
        True, "CUDA, TP>1: row-parallel sums of up to 4 MB (decode steps, lane passes) by "
              "peer loads over symmetric memory instead of NCCL's all-reduce (same bits at "
              "TP=2; at more ranks only the fast path's plain sums); off where it cannot be "
              "set up")
    tp_timeout_s: float = opt(
        30.0, "a collective between TP ranks that does not finish within this many seconds "
              "fails the engine (a lost or stalled worker)")
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sampling: SamplerConfig = field(default_factory=SamplerConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if self.scheduler.mode != self.mode:
            raise ValueError("scheduler.mode must equal mode")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}"
                             + (" (EngineConfig.create resolves 'auto')"
                                if self.dtype == "auto" else ""))
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not 0.0 <= self.fastpath_perturbation <= 1.0:
            raise ValueError("fastpath_perturbation must be in [0, 1]")
        if self.lane_sms is not None and self.lane_sms <= 0:
            raise ValueError("lane_sms must be positive")
        if self.cuda_graph_max_batch <= 0:
            raise ValueError("cuda_graph_max_batch must be positive")
        if self.cuda_graph_step_rows < 0:
            raise ValueError("cuda_graph_step_rows must be >= 0 (0: eager steps)")
        if self.lane_gemm_rows < 0:
            raise ValueError("lane_gemm_rows must be >= 0 (0: chosen automatically)")
        if self.portable_lane and not (self.device.startswith("cuda") and self.align_fast_path):
            raise ValueError("portable_lane needs a CUDA device and align_fast_path (the "
                             "portable kernel and the chunk probe run on GPUs)")
        try:
            lane_variant(TABLE.lane, self.aligned_decode_lane)
        except (TypeError, ValueError) as e:
            raise ValueError(f"aligned_decode_lane: {e}") from None
        if self.batch_invariant_rows <= 0:
            raise ValueError("batch_invariant_rows must be positive")
        self._check_tensor_parallel()
        if self.scheduler.max_model_len > self.cache.num_tokens:
            raise ValueError(
                f"max_model_len {self.scheduler.max_model_len} exceeds the KV cache "
                f"({self.cache.num_tokens} tokens); raise num_blocks"
            )

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or tp & (tp - 1):
            raise ValueError(f"tensor_parallel_size must be a power of two >= 1, got {tp!r}")
        if self.tp_invariant_lane and INVARIANT_LEAVES % tp:
            raise ValueError(f"tp_invariant_lane spans TP sizes dividing {INVARIANT_LEAVES}; "
                             f"got tensor_parallel_size {tp}")
        if self.tp_timeout_s <= 0:
            raise ValueError("tp_timeout_s must be positive")
        if tp > 1 and self.device.startswith("cuda") and (self.lane_threaded or self.lane_sms):
            # two NCCL communicators driven from two threads of each rank stalled the ranks
            # (docs/tensor-parallel.md): at TP>1 on CUDA each rank runs its lane passes in
            # its steps' thread and stream, in rank 0's order
            raise ValueError("at tensor_parallel_size > 1 on CUDA the lane runs in the "
                             "engine's thread: lane_threaded and lane_sms are not available")

    def check_outside_lane(self) -> None:
        """Raise ValueError when this engine cannot hand its lane passes to a verifier in
        another process (which maps or receives its KV pool): the one rule both
        ``LLMEngine`` and the serve config apply. At TP>1 the verifier is dedicated (K/V
        transfer over all ranks, ``parallel.kv_rows``): the pool is sharded, never mapped."""
        if self.tensor_parallel_size > 1 and not self.tp_invariant_lane:
            raise ValueError("tensor_parallel_size > 1 hands its lane to an outside verifier "
                             "only with tp_invariant_lane (a TP=1 verifier reproduces only "
                             "the invariant lane's bits); without it the lane runs in the "
                             "engine")

    @classmethod
    def create(cls, model: str, mode: str = "llm42", *, dtype: str = "auto",
               max_model_len: int | None = None, block_size: int = 16,
               num_blocks: int | None = None, enable_prefix_caching: bool = True,
               **kw: object) -> EngineConfig:
        """Flat keyword constructor used by the offline API, the CLI, the decoders and the
        benchmarks: a keyword naming a ``SchedulerConfig`` or ``SamplerConfig`` field goes
        to that config (its default where absent), the others to ``EngineConfig``.
        ``num_blocks`` None: enough for a full lane of ``max_model_len`` sequences.

        ``dtype="auto"`` and ``max_model_len=None`` are resolved here, from the model's
        metadata (read only then): the dtype by ``model.config.auto_dtype`` (float32 on
        CPU; on CUDA the checkpoint's bfloat16/float16, else bfloat16), the length as the
        model's ``max_position_embeddings`` up to ``DEFAULT_MAX_MODEL_LEN_CAP``. An explicit
        length beyond the model's positions is refused when the engine loads the model.
        """
        if dtype == "auto" or max_model_len is None:
            # torch and the checkpoint readers load only when the model must be read, so
            # that configuration (and the scheduler) stays importable without them
            from detserve.model.config import auto_dtype
            from detserve.model.loader import read_model_config

            model_config = read_model_config(model)
            if dtype == "auto":
                dtype = auto_dtype(model_config, str(kw.get("device", "cpu")))
            if max_model_len is None:
                max_model_len = min(model_config.max_position_embeddings,
                                    DEFAULT_MAX_MODEL_LEN_CAP)
                if max_model_len < model_config.max_position_embeddings:
                    log.warning("max_model_len %d (the model has %d positions; pass "
                                "max_model_len for more)", max_model_len,
                                model_config.max_position_embeddings)
        sched = SchedulerConfig(mode=mode, max_model_len=max_model_len, **{  # type: ignore[arg-type]
            name: kw.pop(name) for name in SCHEDULER_FIELDS if name in kw})
        sampling = SamplerConfig(**{  # type: ignore[arg-type]
            name: kw.pop(name) for name in SAMPLER_FIELDS if name in kw})
        if num_blocks is None:
            num_blocks = max(1024, 2 * sched.max_model_len // block_size + 1)
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            enable_prefix_caching=enable_prefix_caching)
        return cls(model=model, mode=mode, dtype=dtype, scheduler=sched, cache=cache, sampling=sampling,
                   **kw)  # type: ignore[arg-type]
