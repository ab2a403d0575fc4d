"""What every kernel test file (``test_kernels_*.py``) shares.

Importing it patches Triton's interpreter where it runs (``kt.patch_interpreter``). A file
marks its CPU tests ``interp`` and its GPU tests ``needs_cuda`` (with ``pytest.mark.gpu``),
and sets ``test_interpreter_suite = interpreter_suite(__file__)``: on a CPU that test
re-runs the file's non-GPU tests in a ``TRITON_INTERPRET=1`` subprocess (Triton reads the
variable at import, so it never reaches other tests), and the ``interp`` tests run there.
"""

from __future__ import annotations

from collections.abc import Callable

import kernel_helpers as kt
import pytest
import torch

if kt.INTERPRETED:
    kt.patch_interpreter()

interp = pytest.mark.skipif(not kt.INTERPRETED, reason="runs in test_interpreter_suite's subprocess")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def interpreter_suite(test_file: str) -> Callable[[], None]:
    """``test_file``'s ``test_interpreter_suite`` (skipped inside the subprocess it starts)."""

    @pytest.mark.skipif(kt.INTERPRETED, reason="this is the parent of the interpreter run")
    def test_interpreter_suite() -> None:
        kt.run_in_interpreter(test_file)

    return test_interpreter_suite
