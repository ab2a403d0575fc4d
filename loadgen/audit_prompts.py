"""The request rounds of a determinism audit (SGLang ``test_deterministic`` style).

Each mode yields rounds; a round is a list of requests replayed together (so they share
batches), and every request is tagged with the prompt it probes (``tags["probe"]``):
  single  the same prompt at batch sizes 1..n_trials;
  mixed   prompts of different lengths in random multisets per round;
  prefix  prompts sharing a prefix of several lengths, in random multisets per round;
  load    the single prompt sent at spread-out times under Poisson background load, one
          round per QPS (background requests carry ``probe = None``).
Prompt text is seeded word salad cut to a token length with the audit's tokenizer.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from loadgen.tokenizer import Tokenizer
from loadgen.trace import TraceRequest
from loadgen.traffic import TrafficSpec, arrival_times

MODES = ("single", "mixed", "prefix", "load")
_WORDS = ("the river light market stone winter garden letter ocean history music road "
          "quiet engine village morning paper window forest silver question answer "
          "number family doctor island storm bridge teacher summer mountain kitchen "
          "station journey science harbor city lamp promise machine animal weather "
          "evening story painter circle field orange voice empire").split()


@dataclass(frozen=True)
class AuditConfig:
    modes: tuple[str, ...] = MODES
    n_trials: int = 8
    max_tokens: int = 32
    temperature: float = 0.0
    seed: int = 42                      # sampling seed sent with every request
    is_deterministic: bool = True
    logprobs: int | None = 1
    single_len: int = 48
    mixed_lens: tuple[int, ...] = (16, 96, 400)
    prefix_lens: tuple[int, ...] = (1, 64, 256, 511)
    load_qps: tuple[float, ...] = (2.0, 8.0)
    load_requests: int = 24             # background requests per QPS
    load_probes: int = 4                # probe requests per QPS
    load_output_len: int = 32
    prompt_seed: int = 0

    def __post_init__(self) -> None:
        bad = set(self.modes) - set(MODES)
        if bad:
            raise ValueError(f"unknown audit modes {sorted(bad)}; choose from {MODES}")
        if self.n_trials < 1 or self.max_tokens < 1:
            raise ValueError("n_trials and max_tokens must be >= 1")


def words_text(tokenizer: Tokenizer, n_tokens: int, rng: random.Random, head: str = "") -> str:
    """``head`` followed by seeded words, cut to (about) ``n_tokens`` tokens in total."""
    words = [rng.choice(_WORDS) for _ in range(max(4, n_tokens * 2))]
    text = head + " ".join(words)
    ids = tokenizer.encode(text)
    return tokenizer.decode(ids[:max(1, n_tokens)])


class AuditPlan:
    def __init__(self, cfg: AuditConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        rng = random.Random(cfg.prompt_seed)
        self.single_prompt = words_text(tokenizer, cfg.single_len, rng, "Tell a story: ")
        self.mixed_prompts = {f"len{n}": words_text(tokenizer, n, rng, f"Prompt {i}: ")
                              for i, n in enumerate(cfg.mixed_lens)}
        base = words_text(tokenizer, max(cfg.prefix_lens) + 8, rng, "Shared context: ")
        base_ids = tokenizer.encode(base)
        self.prefix_prompts = {
            f"prefix{n}": tokenizer.decode(base_ids[:n]) + f" Question {i}: what next?"
            for i, n in enumerate(cfg.prefix_lens)}
        self._rng = random.Random(cfg.prompt_seed + 1)
        self._count = 0

    def rounds(self, mode: str) -> Iterator[list[TraceRequest]]:
        if mode == "single":
            for bs in range(1, self.cfg.n_trials + 1):
                yield [self._req("single", self.single_prompt) for _ in range(bs)]
        elif mode in ("mixed", "prefix"):
            prompts = self.mixed_prompts if mode == "mixed" else self.prefix_prompts
            for _ in range(self.cfg.n_trials):
                batch = [self._req(f"{mode}/{key}", text) for key, text in prompts.items()
                         for _ in range(self._rng.randint(1, 4))]
                self._rng.shuffle(batch)
                yield batch
        elif mode == "load":
            for qps in self.cfg.load_qps:
                yield self._load_round(qps)
        else:
            raise ValueError(f"unknown audit mode {mode!r}")

    def _load_round(self, qps: float) -> list[TraceRequest]:
        cfg = self.cfg
        times = arrival_times(cfg.load_requests, TrafficSpec(qps=qps, seed=self._count))
        out = []
        for t in times:
            text = words_text(self.tok, self._rng.choice(cfg.mixed_lens), self._rng, "Note: ")
            req = self._req(None, text, is_deterministic=False, max_tokens=cfg.load_output_len)
            out.append(req.with_(arrival_s=t))
        span = times[-1] if times else 0.0
        for k in range(cfg.load_probes):
            at = span * (k + 0.5) / cfg.load_probes
            out.append(self._req("single", self.single_prompt).with_(arrival_s=at))
        return out

    def _req(self, probe: str | None, prompt: str, *, is_deterministic: bool | None = None,
             max_tokens: int | None = None) -> TraceRequest:
        self._count += 1
        cfg = self.cfg
        return TraceRequest(
            id=f"audit-{self._count}", prompt=prompt, prompt_len=len(self.tok.encode(prompt)),
            output_len=max_tokens or cfg.max_tokens, temperature=cfg.temperature,
            seed=cfg.seed,
            is_deterministic=cfg.is_deterministic if is_deterministic is None
            else is_deterministic,
            logprobs=cfg.logprobs, tags={"probe": probe})
