"""scripts/run_pytest.py, which CI's pytest runs through: pytest's exit status comes back
unchanged, and the Python exit handlers still run although CPython's final teardown does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BODY = """
import atexit, os

def test_it():
    atexit.register(lambda: open(os.environ["MARK"], "w").write("ran"))
    assert {outcome}
"""


@pytest.mark.parametrize(("outcome", "status"), [("True", 0), ("False", 1)])
def test_status_and_exit_handlers(tmp_path: Path, outcome: str, status: int) -> None:
    (tmp_path / "test_case.py").write_text(BODY.format(outcome=outcome))
    mark = tmp_path / "mark"
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "scripts.run_pytest", "-q",
         "-p", "no:cacheprovider", str(tmp_path / "test_case.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "MARK": str(mark)})
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert ("1 passed" if status == 0 else "1 failed") in proc.stdout
    assert mark.read_text() == "ran", "the atexit handlers ran before the exit"


def test_no_tests_is_pytest_status() -> None:
    proc = subprocess.run([sys.executable, "-m", "scripts.run_pytest", "-q", "no/such/file.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's "usage error"
