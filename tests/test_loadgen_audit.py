"""The determinism audit: tallies, plumbing on toy targets, and detection on the real
engine (its nondeterministic mode fails the audit; llm42 with fast-path perturbation,
corrected by decode-verify-rollback, passes it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from fake_openai_server import running_server
from model_helpers import make_random_llama

from loadgen.audit import AuditReport, run_audit, tally
from loadgen.audit_prompts import AuditConfig, AuditPlan
from loadgen.cli import main
from loadgen.targets import make_target
from loadgen.targets.base import RequestResult
from loadgen.targets.engine import EngineTarget
from loadgen.tokenizer import ByteTokenizer

SMALL = AuditConfig(n_trials=4, max_tokens=12, mixed_lens=(8, 24, 60), prefix_lens=(1, 16, 48),
                    load_qps=(50.0,), load_requests=8, load_probes=2)


def _r(text: str, lps: list[float] | None = None, ok: bool = True) -> RequestResult:
    return RequestResult("x", True, 3, success=ok, text=text, logprobs=lps,
                         error="" if ok else "e")


def test_tally_counts_outputs_and_logprobs() -> None:
    t = tally([_r("a", [-1.0, -2.0]), _r("a", [-1.0, -2.0]), _r("a", [-1.0, -2.5]),
               _r("b", [-1.0, -3.0])])
    assert (t.samples, t.unique, t.unique_logprobs) == (4, 2, 3)
    assert t.max_logprob_diff == pytest.approx(0.5)      # among the three "a" outputs
    assert not t.deterministic and t.outputs == ["a", "b"]
    t = tally([_r("a"), _r("a"), _r("", ok=False)])
    assert t.unique == 1 and t.failed == 1 and t.unique_logprobs is None
    assert not t.deterministic


def test_plan_rounds_follow_sglang_modes() -> None:
    plan = AuditPlan(SMALL, ByteTokenizer())
    single = list(plan.rounds("single"))
    assert [len(b) for b in single] == [1, 2, 3, 4]
    assert {r.prompt for b in single for r in b} == {plan.single_prompt}
    prefix = [r for b in plan.rounds("prefix") for r in b]
    keys = {r.tags["probe"] for r in prefix}
    assert keys == {"prefix/prefix1", "prefix/prefix16", "prefix/prefix48"}
    texts = sorted(plan.prefix_prompts.values(), key=len)
    assert texts[2].startswith(texts[1][:16]) and texts[1].startswith(texts[0][:1])
    load = next(iter(plan.rounds("load")))
    probes = [r for r in load if r.tags["probe"] == "single"]
    assert len(probes) == 2 and all(r.is_deterministic for r in probes)
    assert sum(r.tags["probe"] is None for r in load) == 8
    assert all(r.seed == SMALL.seed for r in load)
    with pytest.raises(ValueError):
        AuditConfig(modes=("nope",))


def _audit(engine: FakeEngine) -> AuditReport:
    return asyncio.run(run_audit(EngineTarget(engine), SMALL))


def test_audit_passes_a_deterministic_target() -> None:
    rep = _audit(FakeEngine())
    assert rep.passed and rep.max_unique == 1
    assert set(rep.modes) == {"single", "mixed", "prefix", "load", "all"}
    assert rep.modes["all"]["single"].samples == 1 + 2 + 3 + 4 + 2
    assert "PASS" in rep.format()


def test_audit_detects_batch_dependent_outputs() -> None:
    rep = _audit(FakeEngine(nondeterministic=True))
    assert not rep.passed
    assert rep.max_unique > 1
    assert rep.modes["single"]["single"].unique == 4          # one output per batch size
    assert "FAIL" in rep.format()


def test_audit_detects_logprob_only_drift() -> None:
    rep = _audit(FakeEngine(logprob_noise=True))
    assert rep.max_unique == 1 and not rep.passed
    assert rep.modes["single"]["single"].unique_logprobs == 4
    assert "logprobs differ" in rep.verdict()


def test_audit_over_http_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_server(FakeEngine(nondeterministic=True)) as url:
        target = make_target(url)

        async def go() -> AuditReport:
            try:
                return await run_audit(target, SMALL, tokenizer=ByteTokenizer())
            finally:
                await target.aclose()

        rep = asyncio.run(go())
        assert not rep.passed and rep.max_unique > 1
        out = tmp_path / "audit.json"
        args = ["audit", "--target", url, "--tokenizer", "bytes", "--audit-modes", "single",
                "--n-trials", "3", "--max-tokens", "8", "--no-progress", "-o", str(out)]
        assert main(args) == 1                                # expected deterministic: fails
        assert main([*args, "--expect", "nondeterministic"]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["max_unique"] == 3
    assert "Unique samples: 3" in capsys.readouterr().out


# ---- the real engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model() -> str:
    pytest.importorskip("detserve.engine", reason="the engine is not in the tree yet")
    return str(make_random_llama())


def _engine_audit(model: str, mode: str, perturbation: float) -> tuple[AuditReport, dict]:
    target = EngineTarget.from_args(model=model, mode=mode, fastpath_perturbation=perturbation,
                                    verify_window=8, verify_group=4, max_model_len=512, seed=0)
    rep = asyncio.run(run_audit(target, SMALL))
    return rep, target.engine.stats()


def test_real_engine_nondeterministic_mode_fails_audit(tiny_model: str) -> None:
    rep, stats = _engine_audit(tiny_model, "nondeterministic", perturbation=0.5)
    assert not rep.passed, rep.format()
    distinct = max(max(t.unique, t.unique_logprobs or 0)
                   for m in rep.modes.values() for t in m.values())
    assert distinct > 1, rep.format()
    if stats.get("perturbed_tokens", 0) > 0:       # perturbation reaches this mode's tokens
        assert rep.max_unique > 1, rep.format()


def test_real_engine_llm42_passes_audit_despite_perturbation(tiny_model: str) -> None:
    rep, stats = _engine_audit(tiny_model, "llm42", perturbation=0.5)
    assert rep.passed, rep.format()
    assert stats["perturbed_tokens"] > 0 and stats["rollbacks"] > 0
