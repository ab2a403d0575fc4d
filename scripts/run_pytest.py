"""Run pytest and leave with its exit status, without the interpreter's finalization.

The suite starts gRPC channels, gloo groups, Ray and torch thread pools in its own process.
Once pytest has reported, its own clean-up and the Python exit handlers (``atexit``:
multiprocessing's children, the process groups' background aborts) still run; what is left
out is only CPython's final teardown, where native threads still polling (gRPC's, gloo's)
can race the freed interpreter state and end an all-passed run with a segmentation fault
(seen once in CI after "998 passed"). scripts/test.sh runs it as
``python -X faulthandler -m scripts.run_pytest`` (the working directory on the path, as
``python -m pytest`` has it), so that a crash anywhere before that prints every stack.
"""

from __future__ import annotations

import atexit
import os
import sys

import pytest


def main() -> None:
    status = int(pytest.main(sys.argv[1:]))
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
