"""Determinism audit: send the same prompts in different company and count distinct outputs.

For every probed prompt the report gives the number of samples, the number of distinct
outputs (token ids when the target returns them, else text), and, when the target returns
logprobs, the number of distinct logprob vectors and the largest logprob difference among
samples with the most common output. A deterministic server has 1 everywhere; any value
> 1 is a reproducibility failure. The single-mode prompt is also probed in the load
mode, and its tally over both is reported as ``all/single``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loadgen.audit_prompts import AuditConfig, AuditPlan
from loadgen.runner import progress_bar
from loadgen.targets.base import ReplayOptions, RequestResult, Target
from loadgen.tokenizer import ByteTokenizer, Tokenizer
from loadgen.trace import TraceRequest


@dataclass
class PromptTally:
    samples: int = 0
    failed: int = 0
    unique: int = 0
    unique_logprobs: int | None = None
    max_logprob_diff: float | None = None
    outputs: list[str] = field(default_factory=list)   # one example per distinct output

    @property
    def deterministic(self) -> bool:
        return self.failed == 0 and self.unique <= 1 and (self.unique_logprobs or 1) <= 1


def tally(results: Sequence[RequestResult]) -> PromptTally:
    t = PromptTally(samples=len(results))
    ok = [r for r in results if r.success]
    t.failed = len(results) - len(ok)
    keys = [_output_key(r) for r in ok]
    counts = Counter(keys)
    t.unique = len(counts)
    firsts: dict[Any, str] = {}
    for k, r in zip(keys, ok, strict=True):
        firsts.setdefault(k, r.text)
    t.outputs = list(firsts.values())
    with_lp = [r for r in ok if r.logprobs]
    if with_lp and len(with_lp) == len(ok):
        t.unique_logprobs = len({tuple(r.logprobs or ()) for r in with_lp})
        common = counts.most_common(1)[0][0]
        same = [r.logprobs or [] for k, r in zip(keys, ok, strict=True) if k == common]
        ref = same[0]
        t.max_logprob_diff = max((abs(a - b) for lp in same[1:]
                                  for a, b in zip(lp, ref, strict=False)), default=0.0)
    return t


def _output_key(r: RequestResult) -> Any:
    return ("ids", tuple(r.token_ids)) if r.token_ids is not None else ("text", r.text)


@dataclass
class AuditReport:
    config: dict[str, Any]
    target: str
    modes: dict[str, dict[str, PromptTally]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(t.deterministic for m in self.modes.values() for t in m.values())

    @property
    def max_unique(self) -> int:
        return max((t.unique for m in self.modes.values() for t in m.values()), default=0)

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "config": self.config, "passed": self.passed,
                "max_unique": self.max_unique,
                "modes": {m: {k: {**asdict(t), "deterministic": t.deterministic}
                              for k, t in ps.items()} for m, ps in self.modes.items()}}

    def format(self) -> str:
        lines = [f"Determinism audit of {self.target}"]
        for mode, prompts in self.modes.items():
            for key, t in sorted(prompts.items()):
                line = (f"[{mode}] {key}: total samples: {t.samples}, "
                        f"Unique samples: {t.unique}")
                if t.unique_logprobs is not None:
                    line += (f", unique logprob vectors: {t.unique_logprobs}, "
                             f"max logprob diff: {t.max_logprob_diff:.3g}")
                if t.failed:
                    line += f", FAILED requests: {t.failed}"
                lines.append(line)
        lines.append(self.verdict())
        return "\n".join(lines)

    def verdict(self) -> str:
        tallies = [t for m in self.modes.values() for t in m.values()]
        if self.passed:
            return "PASS: every prompt gave one output (and one logprob vector)"
        if self.max_unique > 1:
            return f"FAIL: up to {self.max_unique} distinct outputs for one prompt"
        if any(t.failed for t in tallies):
            return "FAIL: some requests failed"
        worst = max(t.unique_logprobs or 1 for t in tallies)
        return f"FAIL: outputs agree but logprobs differ (up to {worst} distinct vectors)"


async def run_audit(target: Target, cfg: AuditConfig | None = None,
                    tokenizer: Tokenizer | None = None,
                    max_concurrency: int | None = None, progress: bool = False) -> AuditReport:
    """Run the configured audit modes against ``target`` (rounds one after another)."""
    cfg = cfg or AuditConfig()
    tok = tokenizer or target.tokenizer or ByteTokenizer()
    plan = AuditPlan(cfg, tok)
    report = AuditReport(config=asdict(cfg), target=target.label)
    opts = ReplayOptions(max_concurrency=max_concurrency)
    by_probe: dict[tuple[str, str], list[RequestResult]] = {}
    for mode in cfg.modes:
        rounds = list(plan.rounds(mode))
        bar = progress_bar(sum(len(r) for r in rounds), f"audit {mode}", progress)
        for batch in rounds:
            results = await target.replay(batch, opts, on_done=_ticker(bar))
            for req, res in zip(batch, results, strict=True):
                probe = _probe(req)
                if probe is not None:
                    by_probe.setdefault((mode, probe), []).append(res)
        bar.close()
    for (mode, probe), results in by_probe.items():
        report.modes.setdefault(mode, {})[probe] = tally(results)
    singles = [r for (m, p), rs in by_probe.items() if p == "single" for r in rs]
    if len({m for (m, p) in by_probe if p == "single"}) > 1:
        report.modes["all"] = {"single": tally(singles)}
    return report


def _ticker(bar: Any) -> Callable[[RequestResult], None]:
    return lambda _r: bar.update(1)


def _probe(req: TraceRequest) -> str | None:
    probe = req.tags.get("probe")
    return str(probe) if probe is not None else None

