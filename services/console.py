"""The ``detserve`` console: the engine's commands (``generate``, ``fetch-model``), the
serving layer's (``serve``) and load generation's (``bench``) in one parser.

It lives outside the engine library because it sees every part; a part whose extras are
not installed simply contributes no command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from detserve.cli import Subcommand, run
from detserve.cli import build_parser as _build_parser
from detserve.cli import register_detserve_commands as engine_commands


def _registrars() -> list[Callable[[Subcommand], None]]:
    found: list[Callable[[Subcommand], None]] = [engine_commands]
    for mod in ("services.cli", "loadgen.cli"):
        try:
            module = importlib.import_module(mod)
        except ImportError:  # that part's extras are not installed
            continue
        found.append(module.register_detserve_commands)
    return found


def build_parser() -> argparse.ArgumentParser:
    return _build_parser(_registrars())


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
