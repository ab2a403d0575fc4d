"""GPU kernel time per CUDA stream over a profiled window (``bench_offline --profile-steps``).

In llm42 mode the lane runs its passes on a stream of its own beside the fast path's steps.
What a run's totals cannot say is how much GPU time the lane takes and how much of it
overlaps the fast path's kernels; a torch.profiler window can. For each stream: its kernel
time (the sum of its kernels' durations), its busy time (the union of their intervals, so
kernels that overlap on one stream count once) and its top kernels; for the whole GPU: the
busy time of all streams together, and the overlap (the streams' busy times minus it: time
during which two streams ran kernels at once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

# characters of a kernel's name it is grouped by: enough to tell apart ATen's elementwise
# kernels, whose names share their first hundred or so (``elementwise_kernel<128, 4,
# gpu_kernel_impl_nocast<...>>``) and differ only in the functor named after that
NAME_CHARS = 400


def kernel_key(name: str) -> str:
    """The part of a kernel's name the summaries group it by."""
    return name[:NAME_CHARS]


class Kernel(NamedTuple):
    stream: int
    name: str
    start_us: float
    end_us: float


def union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, covered = 0.0, float("-inf")  # covered: the end of the union so far
    for s, e in sorted(spans):
        if e > covered:
            total += e - max(s, covered)
            covered = e
    return total


def cuda_kernels(events: Iterable[Any]) -> list[Kernel]:
    """The CUDA kernels among torch.profiler's events (``prof.events()``)."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    return [Kernel(int(ev.device_resource_id), ev.name, ev.time_range.start, ev.time_range.end)
            for ev in events if ev.device_type == cuda]


def stream_summary(kernels: list[Kernel], steps: int, top: int = 15) -> dict[str, Any]:
    """Per stream (busiest first) and for the GPU, in ms per profiled step."""
    per = max(1, steps) * 1e3  # us over the window -> ms a step
    streams: list[dict[str, Any]] = []
    for sid in sorted({k.stream for k in kernels}):
        mine = [k for k in kernels if k.stream == sid]
        by_name: dict[str, float] = {}
        for k in mine:
            key = kernel_key(k.name)
            by_name[key] = by_name.get(key, 0.0) + k.end_us - k.start_us
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
        streams.append({
            "stream": sid, "kernels": len(mine),
            "kernel_ms_per_step": sum(k.end_us - k.start_us for k in mine) / per,
            "busy_ms_per_step": union_us((k.start_us, k.end_us) for k in mine) / per,
            "top_kernels": [{"name": n, "ms_per_step": t / per} for n, t in ranked]})
    streams.sort(key=lambda s: -s["busy_ms_per_step"])
    busy = union_us((k.start_us, k.end_us) for k in kernels) / per
    window = (max(k.end_us for k in kernels) - min(k.start_us for k in kernels)) / per \
        if kernels else 0.0
    return {"steps": steps, "window_ms_per_step": window, "gpu_busy_ms_per_step": busy,
            "overlap_ms_per_step": sum(s["busy_ms_per_step"] for s in streams) - busy,
            "streams": streams}


def describe(summary: dict[str, Any]) -> list[str]:
    """Lines for the console: the GPU, then each stream with its top kernels."""
    lines = [f"profile of {summary['steps']} steps (ms a step): window "
             f"{summary['window_ms_per_step']:.2f}, GPU busy {summary['gpu_busy_ms_per_step']:.2f}, "
             f"streams overlapping {summary['overlap_ms_per_step']:.2f}"]
    for s in summary["streams"]:
        tops = "; ".join(f"{k['name'][:40]} {k['ms_per_step']:.2f}" for k in s["top_kernels"][:3])
        lines.append(f"  stream {s['stream']}: busy {s['busy_ms_per_step']:.2f}, kernels "
                     f"{s['kernel_ms_per_step']:.2f} ({s['kernels']}): {tops}")
    return lines
