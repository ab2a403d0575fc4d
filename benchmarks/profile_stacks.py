"""Summarise py-spy raw (collapsed) stacks of a decoder replica (``gpu_serving.sh PROFILE=1``).

    python -m benchmarks.profile_stacks decoder-threads.txt[.gz] [--top 15]

Per thread: its samples; for the engine thread (stacks through ``EngineLoop._run``) the
share spent idle (waiting for requests), and of the rest, the deepest frames of our code
(``detserve/``, ``services/``) with the frame the sample ended in. With a ``--gil`` profile
the samples are the threads holding the GIL; with ``--threads --idle``, wall time.
Start-up (imports, model build) lands on the threads that did it; ``--skip-startup``
drops those stacks.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from pathlib import Path

ENGINE = "EngineLoop._run ("
IDLE_LEAVES = ("Condition.wait", "Event.wait")
STARTUP = ("importlib", "Replica.initialize", "Decoder.__init__", "build_engine")


def read(path: Path) -> list[tuple[list[str], int]]:
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if stack and n.isdigit():
                out.append((stack.split(";"), int(n)))
    return out


def thread_name(frames: list[str]) -> str:
    m = re.match(r"thread \(\d+\)(?::\s*(.*))?$", frames[0])
    name = (m.group(1) or "unnamed") if m else "-"
    return ("engine: " if any(f.startswith(ENGINE) for f in frames) else "") + name


def where(frames: list[str]) -> str:
    ours = [f for f in frames if "detserve/" in f or "services/" in f]
    return f"{ours[-1] if ours else '-'}  <  {frames[-1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--skip-startup", action="store_true",
                   help=f"drop stacks through {', '.join(STARTUP)}")
    a = p.parse_args(argv)
    stacks = read(a.file)
    if a.skip_startup:
        stacks = [(f, n) for f, n in stacks if not any(s in x for x in f for s in STARTUP)]
    total = sum(n for _, n in stacks)
    if not total:
        raise SystemExit(f"{a.file}: no samples")
    threads: Counter[str] = Counter()
    spots: dict[str, Counter[str]] = {}
    idle: Counter[str] = Counter()
    for frames, n in stacks:
        name = thread_name(frames)
        threads[name] += n
        if name.startswith("engine") and frames[-1].startswith(IDLE_LEAVES):
            idle[name] += n
            continue
        spots.setdefault(name, Counter())[where(frames)] += n
    print(f"{a.file}: {total} samples")
    for name, n in threads.most_common():
        busy = n - idle[name]
        extra = f", idle {idle[name]} ({idle[name] / n:.0%})" if idle[name] else ""
        print(f"== {name}: {n} ({n / total:.1%}){extra}")
        for spot, k in spots.get(name, Counter()).most_common(a.top):
            print(f"   {k / max(1, busy):6.1%}  {spot[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
