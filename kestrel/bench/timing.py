"""CUDA-event timing shared by the kernel benchmark suites, and the command line of the GPU sweep scripts."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def sweep_script_args(doc: str, add_arguments: Callable[[argparse.ArgumentParser], object] | None = None
                      ) -> tuple[argparse.Namespace, torch.device]:
    """The arguments of a scripts/h200_*_sweep.py: `--out DIR` (created), `--smoke` (tiny shapes on the CPU,
    a check of the script) and any that `add_arguments` adds; the device its kernels run on."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a check of this script)")
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args, torch.device("cpu" if args.smoke else "cuda")


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


def time_calls(calls: list[Callable[[], object]], runs: int, device: torch.device) -> tuple[float, bool]:
    """Median microseconds per call. On CUDA: one graph holding every call, `runs` timed replays."""
    if device.type != "cuda":
        for c in calls:
            c()
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for c in calls:
                c()
            samples.append((time.perf_counter() - t0) * 1e6 / len(calls))
        return statistics.median(samples), False
    try:
        return _time_graph(calls, runs), True
    except Exception:  # a variant that cannot be captured is timed eagerly, and marked so
        torch.cuda.synchronize()
        return time_eager(calls, runs), False


def _time_graph(calls: list[Callable[[], object]], runs: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(3):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e3 / len(calls) for s, e in zip(starts, ends)]
    del graph
    return statistics.median(samples)
