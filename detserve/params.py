"""Per-request sampling parameters (vLLM-style), validated on construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0        # OpenAI's range for a token's bias: [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024  # token ids one request may bias
MAX_PENALTY = 2.0             # OpenAI's range for presence and frequency penalties: [-2, 2]
OUTPUT_KINDS = ("cumulative", "final_only")


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how.

    ``is_deterministic`` asks for bit-exact reproducible output: the same prompt, params and
    seed give the same token ids and logprobs in any batch, on any engine with the same
    determinism profile. ``seed`` feeds the position-hashed Gumbel sampler; when it is None
    the engine's seed is used, so seeded sampling stays reproducible.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    is_deterministic: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: the logprob of each prompt token after the first (and this many top
    # alternatives), as the model predicts it from the tokens before it (loglikelihood
    # scoring, OpenAI's ``echo`` with ``logprobs``). Deterministic requests get them from
    # the lane, bit-exact like their output; their prompt then skips the prefix cache
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    # token id -> a value in [-100, 100] added to its logit before sampling (OpenAI's
    # ``logit_bias``; -100 bans a token, 100 all but forces it). Logprobs stay those of
    # the model's own distribution
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    # OpenAI's penalties, in [-2, 2]: each token already generated (not the prompt's) has
    # its logit lowered by ``presence_penalty`` once and ``frequency_penalty`` per time it
    # occurred, before sampling. Logprobs stay the model's own
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    # "cumulative": an output every step that commits tokens (what streaming needs);
    # "final_only": one output when the request finishes (offline generation: no text is
    # decoded and no output built for the steps in between)
    output_kind: str = "cumulative"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0)
            if self.seed >= 2**63:
                raise ValueError("seed must be < 2**63")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, lo=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if not isinstance(self.is_deterministic, bool):
            raise ValueError("is_deterministic must be a boolean")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs in token order (what the sampler takes)."""
        return tuple(sorted((self.logit_bias or {}).items()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SamplingSpec:
    """What the sampler needs of a request; small and picklable (it travels to verifiers)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: int | None = None
    # vLLM's: the logprob of each prompt token after the first (and this many top
    # alternatives), as the model predicts it from the tokens before it (loglikelihood
    # scoring, OpenAI's ``echo`` with ``logprobs``). Deterministic requests get them from
    # the lane, bit-exact like their output; their prompt then skips the prefix cache
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    prompt_len: int = 0
    stop_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), token ids ascending
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # whether a row's logits depend on the tokens generated before it (derived: a plain
    # attribute, read for every row of every step)
    penalized: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "penalized",
                           bool(self.presence_penalty or self.frequency_penalty))


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite")


def _check_logit_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise ValueError("logit_bias must map token ids to numbers")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} token ids")
    out: dict[int, float] = {}
    for token, value in bias.items():
        _check_int("logit_bias token id", token, lo=0)
        _check_number("logit_bias value", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token}")
        out[token] = float(value)
    return out
