"""Engine configuration: one frozen dataclass per component, validated on construction."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, fields

from detserve.kernels.config import TABLE, lane_variant  # (no triton: table and checks only)

MODES = ("llm42", "nondeterministic", "batch_invariant", "lane_only")
BLAS_LIBRARIES = ("default", "cublas", "cublaslt")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)  # what callers may ask for; ``EngineConfig.create`` resolves
# max_model_len when none is given: the model's positions, but no more than this. The KV
# cache is sized from max_model_len (``EngineConfig.create``), so a model with a long
# context (Llama-3.1: 131072 positions) would otherwise allocate a cache of many GiB by
# default; a longer context is asked for explicitly
DEFAULT_MAX_MODEL_LEN_CAP = 8192
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024  # block 0 is reserved as the padding rows' scratch block
    enable_prefix_caching: bool = True  # share lane-computed prompt blocks (lane seqs only)

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
    """How ``launch_rows`` picks many rows on CUDA (CPU always goes row by row, but for the
    greedy argmax). Only ``logprob_kernel`` changes bits (kernel set tag "+lpk"; a verifier
    gets it from the decoder with the lane's geometry); the others give row-by-row bits."""

    # sampled rows without top-p, logprobs, a stop mask or a logit bias are picked together
    # (``gumbel_rows``; torch's kernels over this many rows at a time) instead of one by one
    # (about fifty small launches a row). 0: always one by one
    gumbel_chunk_rows: int = 64
    # gumbel_rows runs one Triton pass (kernels.gumbel) instead of torch's kernels
    gumbel_kernel: bool = True
    # rows asking for logprobs take the many-row paths too, their logprobs from one pass
    # (kernels.logprobs: a row's bits the same in any batch, but the kernel's own, not
    # log_softmax's). On since its GPU tests passed on an H100 (tests/test_kernels_logprobs.py,
    # tests/test_gpu_engine.py): 512 rows with 5 logprobs each in 2.5 ms against 137 ms
    # row by row (``benchmarks/gpu_suite.sh logprobs``; docs/benchmarks/gpu/README.md)
    logprob_kernel: bool = True

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

    mode: str = "llm42"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    verify_window: int = 64
    verify_group: int = 8
    # steps a lane pass waits to fill once work is ready for it. 16 measured better than 8
    # at 10 % deterministic traffic on the 8B shape (H100: 6,231.7 vs 6,209.9 out tok/s,
    # medians of two; 118 passes vs 150), at the cost of a deterministic prompt's first
    # token waiting up to 8 steps more while others decode
    lane_max_wait_steps: int = 16
    # while a window is in the lane, its sequence keeps decoding the next window on the
    # fast path (kept if the lane commits the whole window and agrees on its next token)
    overlap_windows: bool = True
    # when more than this share of the running sequences can only move once the lane
    # answers (prompt chunks or windows queued there) and a lane pass is in flight, a step
    # gives the GPU to that pass (no fast rows) instead of spending a decode step (a whole
    # weight read) on the few others: the lane and the fast path share the GPU, so the next
    # step carries more rows. 1: never. 0.2 measured best of 0.5/0.3/0.2 at 100 %
    # deterministic traffic on an H100 (docs/benchmarks/gpu/README.md). A verifier on a
    # GPU of its own would not share it: there, 1
    lane_bound_fraction: float = 0.2
    # whether lane sequences' decode rows join fast steps that also carry prefill rows. On
    # CUDA such rows must run their products as a call of their own, padded to a bucket in
    # the lane chunk's cuBLAS class (a second weight read for the step); with False they sit
    # out every other such step, and when none joins, the step's products run as one call
    lane_decode_in_mixed_steps: bool = True
    # a long prompt goes to the lane in chunks; with True a sequence sends its next chunk
    # while the previous one is still in the lane (passes run in order, so each chunk finds
    # the K/V of the ones before it), instead of one lane round trip per chunk
    pipeline_lane_prefill: bool = True
    # a sequence whose full window waits for the pass to fill (``lane_max_wait_steps``)
    # keeps decoding past it (the next window's candidates, kept if the lane commits the
    # whole window, as with ``overlap_windows``), and windows then wait, past
    # ``lane_max_wait_steps``, until the pass is full or one of their sequences may decode
    # no further: fewer, fuller passes at low deterministic traffic, no sequence stalled
    # for it. Prompt chunks still wait at most ``lane_max_wait_steps`` (time to first token)
    decode_past_queued_windows: bool = True
    # prompts not yet started wait (the step stays decode-only: a CUDA graph replay) until
    # this many of their tokens are pending or the oldest has waited
    # ``prefill_max_wait_steps`` steps: on CUDA an eager step with prefill rows costs the
    # host about the same whatever its size up to a few hundred tokens, so arrivals one by
    # one would each cost such a step. Never while the step is eager anyway (a prompt's
    # later chunks) or has no decode row. None: max_num_batched_tokens // 4 on CUDA, 0 (no
    # wait) on CPU, where the engine decides
    prefill_batch_tokens: int | None = None
    prefill_max_wait_steps: int = 8
    # ``max_num_seqs`` bounds the sequences a fast step carries (vLLM's "sequences per
    # iteration"). A lane sequence parked on the lane (its prompt or a full window queued
    # there, or decoded as far past a window in flight as allowed) is in no fast step, so
    # while some are, admission lets that many more sequences run, up to this share of
    # ``max_num_seqs``: the fast path keeps its batch full instead of idling the slots of
    # sequences that wait for verification. 0: every running sequence holds a slot
    parked_seq_headroom: float = 0.125
    # a lane pass that goes out with rows to spare fills them with the prompts of
    # deterministic requests still queued behind others, admitting them ahead of the queue
    # while at most this many running lane sequences still wait for their prompt's lane
    # prefill (and the KV pool keeps a block for every running sequence). Every prompt row
    # has to go through the lane once anyway: rows that would be padding do it, so passes
    # run fuller and fewer. A row's lane bits do not depend on its chunking, so no output
    # changes. 0: only admitted sequences' prompts (llm42 only; lane_only keeps FCFS)
    lane_prefill_ahead: int = 8
    # how far from the head of the queue such prompts are taken: a deterministic request
    # moves ahead of at most this many others. On an H100 at 10 % deterministic traffic
    # (8B shape, 1,024 requests queued at once; docs/benchmarks/gpu/README.md), 32 gave
    # 0.946x nondeterministic's throughput (one run; 0.944x-0.947x without the option), the
    # others' mean finish unchanged. A lookahead over the whole queue (as long as the
    # queue) gave 0.953x-0.955x (medians of two, two calls), as deterministic prompts
    # filled passes from the start (101 passes, 7.9 % padding, against 114-117 and
    # 12-14 %), but it moved them all to the front: their mean finish 5.0 s against 12.7
    # s, the others' 12.8 s against 11.9 s. That lets any request jump the queue by
    # asking for determinism, so it is not the default
    lane_prefill_lookahead: int = 32
    # a lane pass with rows to spare up to the size it runs at (``Scheduler.lane_sizes``)
    # after its windows and prompt chunks fills them with partial windows: the candidates
    # so far of lane sequences in the middle of a window, most first. They are verified
    # sooner and the next window starts after them; the lane's verdict on a token does not
    # depend on where its window starts, so no output changes. Rows that would be padding
    # verify tokens that later passes then need not carry. On an H100 at 10 % deterministic
    # traffic (8B shape; docs/benchmarks/gpu/README.md), two calls, medians of two: 0.949x
    # nondeterministic's throughput with it against 0.945x and 0.947x without; padding
    # among computed lane rows 5 % against 11-12 %, 106-108 passes against 113-116
    lane_partial_windows: bool = True
    # with lane_partial_windows: the candidates of lane sequences mid-window count toward
    # filling the pass, so a pass goes out as soon as its windows, prompt chunks and those
    # candidates fill all ``lane_rows`` (partial windows then fill it to the last row),
    # instead of waiting for full windows alone and running at a smaller lane size. Off:
    # in the same measurement 102-103 passes, no faster (0.949x against 0.949x), as
    # smaller pieces of windows each take one more row
    lane_partial_fill: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "verify_window", "verify_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("lane_max_wait_steps", "prefill_max_wait_steps"):
            if getattr(self, name) < 0:
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
        if self.lane_partial_fill and not self.lane_partial_windows:
            raise ValueError("lane_partial_fill needs lane_partial_windows")

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


# the scheduler's options by name (``EngineConfig.create``; the mode is the engine's)
SCHEDULER_FIELDS = tuple(f.name for f in fields(SchedulerConfig) if f.name != "mode")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    mode: str = "llm42"
    device: str = "cpu"
    dtype: str = "float32"  # one of DTYPES ("auto" is resolved by ``create``)
    seed: int = 0
    fastpath_perturbation: float = 0.0
    batch_invariant_rows: int = 32  # fixed row-chunk of batch_invariant mode (CPU reference)
    lane_threaded: bool = False     # run lane passes on a worker thread (always on CUDA)
    lane_sms: int | None = None     # CUDA: SMs of the lane's green context (None: shared)
    # CUDA: cuBLAS picks the fast path's and the lane's GEMM kernels for this many SMs
    # fewer than the GPU has (torch's SM carveout; CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET).
    # With ``lane_sms`` the same number, a lane kernel holding its green context's SMs no
    # longer leaves a fast-path GEMM's last wave waiting for them. Process-wide (every
    # engine in the process sets it, None clearing it) and part of the numerics a verifier
    # must share (``kernels`` tag ``+carve<n>``). Measured slower, so off: on an H100 torch's
    # cuBLAS path ignored it (same kernels), cuBLASLt honoured it, and the decode-size GEMMs
    # still ran 1.28x-1.44x slower beside a lane GEMM on 32 SMs (they need the bandwidth of
    # every SM); at 10 % deterministic traffic llm42 read 0.925x-0.941x nondeterministic's
    # throughput with it against 0.947x without (bench_sm_carveout, bench_offline)
    sm_carveout: int | None = None
    # CUDA: torch's preferred BLAS library for every GEMM in the process ("default": torch's
    # choice, overriding TORCH_BLAS_PREFER_CUBLASLT; "cublas" or "cublaslt";
    # torch.backends.cuda.preferred_blas_library). Also part of the numerics (tag
    # ``+blas-<name>``) when not "default"
    blas_library: str = "default"
    # CUDA: the lane stream's priority against the fast path's. "high": when both have
    # kernels waiting, the lane's go first (windows come back sooner); "normal": the same
    # priority; "low": the fast path runs on a stream of high priority, so its kernels' blocks
    # go onto SMs before the lane's whenever both wait (a lane kernel never holds a decode
    # step back by more than its running blocks)
    lane_priority: str = "high"
    # the lane's passes run beside the fast path's steps (True, the design), or a step that
    # has a pass in flight waits for its result before the next step's batch is queued
    # (False: on a GPU each pass then runs alone, as LLM-42's prototype ran verification,
    # and every sequence's decoding stalls for its length; a measurement, not a default)
    lane_overlap: bool = True
    cuda_graphs: bool = True        # CUDA: graphs for decode batches and the lane pass
    cuda_graph_max_batch: int = 256  # largest decode batch captured (bigger ones run eagerly)
    # CUDA: steps that carry prompt chunks of up to this many rows (capped by the token
    # budget) replay graphs too (executor/graphs.StepGraphs); bigger ones, and all with 0,
    # run eagerly
    cuda_graph_step_rows: int = 2048
    # CUDA: make the fast path and the lane agree bit for bit as often as possible, so that
    # few windows roll back. Fast-path decode rows whose context needs no split run the
    # lane's attention kernel, and the lane runs its products in chunks of
    # ``lane_gemm_rows`` rows (0: chosen by probing cuBLAS: a chunk in a class that holds
    # the fast path's decode batches, padded per product where needed, and lets a lane
    # pass run each product in as few calls as it can, one on the 8B shape on an H100; see
    # gemm_classes.plan_alignment). On CPU,
    # ``lane_gemm_rows`` > 0 is the lane's row chunk for products and attention, and a pass
    # computes only the chunks its rows fill (0: the whole G*W pass, always).
    align_fast_path: bool = True
    lane_gemm_rows: int = 0
    # CUDA, with align_fast_path: probe at start-up, for every eager step size, which
    # products give the leading decode rows the lane chunk's bits in one call over all the
    # step's rows; those products then run unsplit (gemm_classes.single_call_sizes)
    probe_single_calls: bool = True
    # CUDA: the lane runs a product as one call over k chunks' rows where a start-up probe
    # found that call to give every row the chunk's bits (gemm_classes.lane_call_sizes): one
    # read of the weight instead of k, the same arithmetic. False: always chunk by chunk
    lane_one_calls: bool = True
    # with lane one calls: a pass also runs at sizes between the chunk's multiples, in steps
    # of this many rows (those where some product runs as one call), padding its rows to
    # the next size instead of the next multiple; each size is one more lane graph. 0: only
    # the multiples. 0 by default: on an H100 at 10 % deterministic traffic, steps of 32
    # computed about 17 % fewer lane rows yet cost 0.7 % of throughput (docs/benchmarks/gpu)
    lane_size_step: int = 0
    # CUDA: the lane attention kernel's split size in positions (``LaneConfig.split``; 0: no
    # split). Splits sit at absolute positions and merge in order, so bits still depend on
    # a row alone; a decode row's context is then walked by several programs at once (the
    # kernel is latency-bound on long rows otherwise). The lane and the fast path's aligned
    # decode rows use it alike, and it is part of the numerics a verifier must share. Rows
    # past the first split get other bits than with 0. Slower on an H100 at every size tried
    # (docs/benchmarks/gpu/README.md), so off
    lane_attention_split: int = 0
    # CUDA: the lane attention kernel runs the KV tiles every slot of a program sees whole
    # without the position masks (``LaneConfig.full_tiles``; the lane and the aligned decode
    # rows alike): the masked kernel's bits, faster (docs/benchmarks/gpu/README.md). Not
    # part of the numerics, so a verifier replica with the other setting agrees
    lane_full_tiles: bool = True
    # CUDA, aligned fast path: the lane kernel's query tile and launch for the fast path's
    # decode rows, "BLOCK_M:NUM_WARPS:NUM_STAGES" ("": the lane's own; "auto": 16:2:3 with
    # dot sums and no split, else the lane's own). A decode row fills only its query heads'
    # slots of the tile, so a smaller tile is faster. With dot sums every tile keeps the
    # lane's bits; without, only some do (bench_kernels' lane sweep says which), else the
    # windows it decodes roll back (never wrong output: the lane verifies them)
    aligned_decode_lane: str = "auto"
    # CUDA: the lane kernel sums a row's probabilities over a tile as a matrix product with
    # ones (``LaneConfig.dot_sums``): the lane's bits do not depend on the query tile or
    # warps, so decode rows take a one-row kernel with a small tile, as fast as split-KV
    # (docs/benchmarks/gpu/README.md). Part of the numerics: False (``tl.sum``) is another
    # kernel set ("+plainsums"), which a verifier must share
    lane_dot_sums: bool = True
    # CUDA: SiLU-and-multiply as one Triton kernel (``kernels.silu_mul``) instead of torch's
    # two elementwise kernels over strided halves (the fast path, the lane and
    # batch_invariant alike). It gives torch's bits (tests/test_kernels_silu_mul.py and
    # tests/test_gpu_engine.py on an H200), so it is not part of the numerics: the same
    # kernel set either way. On by default: a decode step of the 8B shape at batch 64
    # takes 6.39 ms with it against 6.52 on an H200 (docs/benchmarks/gpu/README.md)
    fused_silu_mul: bool = True
    # CUDA, with ``align_fast_path`` (llm42): a decode step none of whose rows the lane will
    # verify (no deterministic request decodes in it) replays graphs of the plain fast path,
    # as nondeterministic mode runs them (split-KV attention, no product padded into the
    # lane's class), instead of the aligned ones: the alignment costs only steps that carry
    # a deterministic decode row. One more set of decode graphs (captured at start-up)
    plain_decode_graphs: bool = True
    # CUDA: the residual add before each RMSNorm in the norm's own kernel
    # (``batch_invariant.add_rmsnorm_bi``: the sum as torch adds, the norm's bits of it)
    # instead of a torch add first. The same bits (GPU-tested like the above), so the same
    # kernel set; on by default (with the fused SiLU: 6.31 ms against 6.52)
    fused_add_rmsnorm: bool = True
    # CUDA: how many rows are sampled at once (``SamplerConfig``): sampled rows
    # ``gumbel_chunk_rows`` at a time (0: row by row), in one Triton pass
    # (``gumbel_kernel``), and rows with logprobs too, with their logprobs from one pass
    # (``logprob_kernel``: its own bits, kernel set "+lpk"; False: row by row)
    gumbel_chunk_rows: int = 64
    gumbel_kernel: bool = True
    logprob_kernel: bool = True
    # plan and queue each step's fast batch before reading the previous step's tokens, so
    # the host's work between steps overlaps the device's (None: on for CUDA, off on CPU)
    async_scheduling: bool | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    @property
    def sampling(self) -> SamplerConfig:
        return SamplerConfig(self.gumbel_chunk_rows, self.gumbel_kernel, self.logprob_kernel)

    def __post_init__(self) -> None:
        self.sampling  # noqa: B018 (SamplerConfig validates its fields)
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
        if self.sm_carveout is not None and (isinstance(self.sm_carveout, bool)
                                             or not isinstance(self.sm_carveout, int)
                                             or self.sm_carveout <= 0):
            raise ValueError("sm_carveout must be a positive integer (None: no carveout)")
        if self.blas_library not in BLAS_LIBRARIES:
            raise ValueError(f"blas_library must be one of {', '.join(BLAS_LIBRARIES)}, "
                             f"got {self.blas_library!r}")
        if self.lane_priority not in ("high", "normal", "low"):
            raise ValueError("lane_priority must be 'high', 'normal' or 'low', "
                             f"got {self.lane_priority!r}")
        if self.cuda_graph_max_batch <= 0:
            raise ValueError("cuda_graph_max_batch must be positive")
        if self.cuda_graph_step_rows < 0:
            raise ValueError("cuda_graph_step_rows must be >= 0 (0: eager steps)")
        if self.lane_gemm_rows < 0:
            raise ValueError("lane_gemm_rows must be >= 0 (0: chosen automatically)")
        if isinstance(self.lane_size_step, bool) or not isinstance(self.lane_size_step, int) \
                or self.lane_size_step < 0:
            raise ValueError("lane_size_step must be an integer >= 0 (0: the chunk's multiples)")
        try:  # (the kernel's own check: 0 or a multiple of its tile)
            dataclasses.replace(TABLE.lane, split=self.lane_attention_split)
        except (TypeError, ValueError) as e:
            raise ValueError(f"lane_attention_split: {e}") from None
        try:
            lane_variant(TABLE.lane, self.aligned_decode_lane)
        except (TypeError, ValueError) as e:
            raise ValueError(f"aligned_decode_lane: {e}") from None
        if self.batch_invariant_rows <= 0:
            raise ValueError("batch_invariant_rows must be positive")
        if self.scheduler.max_model_len > self.cache.num_tokens:
            raise ValueError(
                f"max_model_len {self.scheduler.max_model_len} exceeds the KV cache "
                f"({self.cache.num_tokens} tokens); raise num_blocks"
            )

    @classmethod
    def create(cls, model: str, mode: str = "llm42", *, dtype: str = "auto",
               max_model_len: int | None = None, block_size: int = 16,
               num_blocks: int | None = None, enable_prefix_caching: bool = True,
               **kw: object) -> EngineConfig:
        """Flat keyword constructor used by the offline API, the CLI, the decoders and the
        benchmarks: a keyword naming a ``SchedulerConfig`` field goes to the scheduler (its
        default where absent), the others to ``EngineConfig``.

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
        if num_blocks is None:
            # enough for a full lane of long sequences plus headroom
            num_blocks = max(1024, 2 * sched.max_model_len // block_size + 1)
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            enable_prefix_caching=enable_prefix_caching)
        return cls(model=model, mode=mode, dtype=dtype, scheduler=sched, cache=cache,
                   **kw)  # type: ignore[arg-type]
