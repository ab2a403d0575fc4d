"""Regenerate the Python code of every ``proto/*.proto`` into its service folder.

    python proto/gen.py          # from the repository root (or anywhere)
    python proto/gen.py --check  # exit 1 if the checked-in code is out of date

Uses ``python -m grpc_tools.protoc`` (grpcio-tools must not be newer than the grpcio we
run, 1.84). protoc writes ``import x_pb2`` for messages of another file, which only works
with the output folder on sys.path; the imports are rewritten to ``from services.x import
x_pb2`` so the modules import as parts of their package. ``.pyi`` stubs are written too,
so mypy sees the message classes (protobuf builds them at run time).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
# proto file -> folder (relative to the repository root) that receives its modules; a proto
# missing here goes to services/<stem>/.
OUTPUTS = {
    "verifier.proto": "services/verifier",
    "detserve.proto": "services/router",
    "link.proto": "services/decoder",
}
_IMPORT = re.compile(r"^import (\w+_pb2(?:_grpc)?) as (\w+)$", re.MULTILINE)


def output_dir(proto: Path) -> str:
    return OUTPUTS.get(proto.name, f"services/{proto.stem}")


def _package_of(module: str, protos: list[Path]) -> str | None:
    stem = module.removesuffix("_grpc").removesuffix("_pb2")
    for p in protos:
        if p.stem == stem:
            return output_dir(p).replace("/", ".")
    return None


def _fix_imports(text: str, protos: list[Path]) -> str:
    def repl(m: re.Match[str]) -> str:
        pkg = _package_of(m.group(1), protos)
        return f"from {pkg} import {m.group(1)} as {m.group(2)}" if pkg else m.group(0)

    return _IMPORT.sub(repl, text)


def generate(dest_root: Path) -> list[Path]:
    """Write every proto's modules under ``dest_root``; returns the files written."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    written = []
    for proto in protos:
        out = dest_root / output_dir(proto)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
                   f"--python_out={tmp}", f"--pyi_out={tmp}",
                   f"--grpc_python_out={tmp}",
                   str(proto)]
            subprocess.run(cmd, check=True)
            for f in sorted(Path(tmp).iterdir()):
                target = out / f.name
                text = _fix_imports(f.read_text(), protos)
                if f.suffix == ".pyi":  # typed stubs for mypy; generated style is not ours
                    text = "# ruff: noqa\n" + text
                target.write_text(text)
                written.append(target)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    if not args.check:
        for f in generate(ROOT):
            print(f.relative_to(ROOT))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [f.relative_to(tmp) for f in generate(Path(tmp))
                 if not (ROOT / f.relative_to(tmp)).is_file()
                 or (ROOT / f.relative_to(tmp)).read_text() != f.read_text()]
        shutil.rmtree(tmp, ignore_errors=True)
    for f in stale:
        print(f"out of date: {f}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
