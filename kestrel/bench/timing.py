"""CUDA-event timing shared by the kernel benchmark suites."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_eager(calls: list[Callable[[], object]], runs: int) -> float:
    """Median microseconds per call over `runs` rounds of `calls` (one warm-up round first)."""
    for c in calls:
        c()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for s, e in zip(starts, ends):
        s.record()
        for c in calls:
            c()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 / len(calls) for s, e in zip(starts, ends))
