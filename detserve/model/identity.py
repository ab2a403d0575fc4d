"""``ModelInfo``: what identifies a loaded model. ``loader.load_model`` and
``random_init.random_model`` both return one, so it lives below both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelInfo:
    """What identifies a loaded model in a determinism fingerprint."""

    name: str
    source: Path
    # sha256 hex. One file: that file's digest (``sha256sum`` gives the same); several
    # files: digest of the sorted ``"<digest>  <name>\n"`` lines. An HF folder's
    # config.json is included, since it changes the numerics as much as the weights do.
    weights_hash: str
    dtype: str
