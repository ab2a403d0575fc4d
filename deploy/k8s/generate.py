"""Write the generated overlay files, or check that they are up to date.

    python -m deploy.k8s.generate          # rewrite overlays/*/{rayservice,engine-configmap}.yaml
    python -m deploy.k8s.generate --check  # exit 1 if any of them differs from manifests.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.k8s.manifests import generated_files

K8S_DIR = Path(__file__).resolve().parent


def stale_files(root: Path = K8S_DIR) -> list[str]:
    """Generated files whose content on disk differs from what manifests.py produces."""
    return [
        rel for rel, text in generated_files().items()
        if not (root / rel).is_file() or (root / rel).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    opts = parser.parse_args(argv)
    if opts.check:
        stale = stale_files()
        for rel in stale:
            print(f"stale: deploy/k8s/{rel} (run python -m deploy.k8s.generate)")
        return 1 if stale else 0
    for rel, text in generated_files().items():
        path = K8S_DIR / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote deploy/k8s/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
