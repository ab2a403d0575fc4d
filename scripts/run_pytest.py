"""Run pytest and leave with its exit status, without the interpreter's finalization.

The suite leaves native threads running in its own process until it exits (seen at its
end: Ray's driver threads and Serve's router loop, gRPC's timers, a torch TCP store's
server). Once pytest has reported, its own clean-up and the Python exit handlers
(``atexit``: multiprocessing's children, the process groups' background aborts) still run;
what is left out is only CPython's final teardown, where such threads can race the freed
interpreter state and end an all-passed run with a segmentation fault (seen once in CI
after "998 passed"; which thread it was is not known). scripts/test.sh runs it as
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
