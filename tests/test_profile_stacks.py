"""benchmarks.profile_stacks: per-thread summary of py-spy collapsed stacks."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from benchmarks.profile_stacks import main, read, thread_name

ENGINE = ("thread (11): engine-x;Thread.run (threading.py:982);"
          "EngineLoop._run (services/decoder/engine_loop.py:122)")
LINES = [
    f"{ENGINE};LLMEngine.step (detserve/engine.py:205);sample_rows (detserve/sampler.py:100) 8",
    f"{ENGINE};LLMEngine.step (detserve/engine.py:205);Scheduler.schedule (detserve/scheduler.py:131) 2",
    f"{ENGINE};Condition.wait (threading.py:331) 10",
    "thread (12): AsyncIO Thread: default;Decoder.channel (services/decoder/deployment.py:174) 5",
    "thread (12): AsyncIO Thread: default;<module> (detserve/engine.py:21);"
    "_call_with_frames_removed (<frozen importlib._bootstrap>:488) 75",
]


@pytest.fixture()
def raw(tmp_path: Path) -> Path:
    path = tmp_path / "decoder-threads.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(LINES) + "\n")
    return path


def test_threads_idle_share_and_spots(raw: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stacks = read(raw)
    assert sum(n for _, n in stacks) == 100
    assert thread_name(stacks[0][0]) == "engine: engine-x"
    assert thread_name(stacks[3][0]) == "AsyncIO Thread: default"
    assert main([str(raw)]) == 0
    out = capsys.readouterr().out
    assert "100 samples" in out
    assert "== engine: engine-x: 20 (20.0%), idle 10 (50%)" in out
    # of the engine's 10 busy samples, 8 wait in the step's GPU sync
    assert "80.0%  sample_rows (detserve/sampler.py:100)" in out
    assert main([str(raw), "--skip-startup"]) == 0
    out = capsys.readouterr().out
    assert "25 samples" in out and "== AsyncIO Thread: default: 5 (20.0%)" in out


def test_empty_profile_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "x.txt"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no samples"):
        main([str(empty)])
