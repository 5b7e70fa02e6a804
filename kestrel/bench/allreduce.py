"""`kestrel bench allreduce`: the all-reduce cost of a tensor-parallel decode step, against the bus bandwidth.

A tensor-parallel decoder layer ends its attention (o_proj) and its MLP (down_proj) with one all-reduce of the
step's hidden states each, `[tokens, hidden]` in BF16: two per layer. For each decode batch (tokens) and hidden
size this times that all-reduce over `--world-size` ranks and reports microseconds per all-reduce, per layer
(two) and per decode step (x the layers of the model of that hidden size: 32 for Llama-3-8B's 4096, 80 for
Llama-3-70B's 8192).

The yardstick is measured in the same job: one large all-reduce (`--bandwidth-mib`), from which the algorithm
bandwidth (bytes / time) and the bus bandwidth (algorithm bandwidth x 2 (n - 1) / n, nccl-tests' definition:
the per-link rate a ring all-reduce sustains) follow. Each point's bandwidth-bound time is its bytes moved over
that bus bandwidth; small messages are latency-bound, and the ratio says by how much.

Every rank times the same calls (host clock on the CPU, CUDA events around a loop of eager all-reduces on a GPU,
as tensor-parallel decode runs them today); a point's time is the slowest rank's median over `--repeats` loops.
Each shape's result is checked first (every rank holds rank + 1; the sum must be n (n + 1) / 2 everywhere).
The ranks are processes this bench spawns and reaps (NCCL on GPUs, gloo on the CPU for `--smoke`).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kestrel.bench import common, register_suite, standalone_main
from kestrel.config import ConfigError
from kestrel.executor.base import free_port

ALL_REDUCES_PER_LAYER = 2  # o_proj and down_proj, the row-parallel layers
LAYERS_BY_HIDDEN = {4096: 32, 8192: 80}  # Llama-3-8B, Llama-3-70B
SMOKE = {"tokens": "1,8", "hidden": "64,128", "iters": 4, "repeats": 2, "warmups": 1, "bandwidth_mib": 1}


@dataclass(frozen=True)
class Task:
    """What every rank runs; picklable."""

    world_size: int
    device_type: str
    init_method: str
    tokens: tuple[int, ...]
    hiddens: tuple[int, ...]
    iters: int
    repeats: int
    warmups: int
    bandwidth_bytes: int
    timeout_s: float


def bus_factor(world_size: int) -> float:
    """Bus bandwidth / algorithm bandwidth of an all-reduce (nccl-tests): 2 (n - 1) / n."""
    return 2.0 * (world_size - 1) / world_size


# ------------------------------------------------------------------------------------------------ ranks


def _time_loop(x: torch.Tensor, iters: int, device: torch.device) -> float:
    """Seconds per all-reduce over one loop of `iters` calls, started together on every rank."""
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    began = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return (time.perf_counter() - began) / iters


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _measure(task: Task, rank: int, device: torch.device, numel: int, iters: int) -> tuple[float, bool]:
    """(the slowest rank's median seconds per all-reduce of `numel` BF16 values, whether the sum was right)."""
    x = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device=device)
    dist.all_reduce(x)
    expected = task.world_size * (task.world_size + 1) / 2
    correct = bool((x == expected).all())
    x.normal_()  # never time on constant data
    for _ in range(task.warmups):
        _time_loop(x, iters, device)
    times = [_slowest(_time_loop(x, iters, device), device) for _ in range(task.repeats)]
    return statistics.median(times), correct


def rank_main(rank: int, task: Task, results: Any) -> None:
    """One rank: join the group, measure, rank 0 puts the result (or any rank its error) on `results`."""
    try:
        device = torch.device("cpu")
        if task.device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=task.init_method, rank=rank, world_size=task.world_size,
                                timeout=timedelta(seconds=task.timeout_s))
        try:
            big_numel = task.bandwidth_bytes // 2
            big_s, big_ok = _measure(task, rank, device, big_numel, max(2, task.iters // 10))
            points = []
            for hidden in task.hiddens:
                for tokens in task.tokens:
                    seconds, ok = _measure(task, rank, device, tokens * hidden, task.iters)
                    points.append({"hidden": hidden, "tokens": tokens, "seconds": seconds, "correct": ok})
            if rank == 0:
                results.put(("ok", {"bandwidth": {"bytes": big_numel * 2, "seconds": big_s, "correct": big_ok},
                                    "points": points, "backend": backend}))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - handed to the parent, which reports it
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))
        raise


def run_ranks(task: Task, timeout_s: float) -> dict[str, Any]:
    """Spawn the ranks, wait for rank 0's result, and reap every process (killing any left after `timeout_s`)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(rank, task, results), name=f"kestrel-allreduce-{rank}")
             for rank in range(task.world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                status, value = results.get(timeout=1.0)
                break
            except Exception:  # noqa: BLE001 - queue.Empty: look at the processes, then wait again
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the ranks did not finish within {timeout_s:.0f} s") from None
        if status == "error":
            raise RuntimeError(value)
        return value
    finally:
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        results.close()


# ------------------------------------------------------------------------------------------------ result


def build_result(raw: dict[str, Any], task: Task, device_type: str) -> dict[str, Any]:
    n = task.world_size
    big = raw["bandwidth"]
    algbw = big["bytes"] / big["seconds"]
    busbw = algbw * bus_factor(n)
    rows = []
    for p in raw["points"]:
        nbytes = p["tokens"] * p["hidden"] * 2
        us = 1e6 * p["seconds"]
        bound_us = 1e6 * nbytes * bus_factor(n) / busbw
        layers = LAYERS_BY_HIDDEN.get(p["hidden"])
        rows.append({
            "hidden": p["hidden"], "tokens": p["tokens"], "bytes": nbytes, "us_per_allreduce": us,
            "us_per_layer": ALL_REDUCES_PER_LAYER * us, "layers": layers,
            "ms_per_decode_step": ALL_REDUCES_PER_LAYER * us * layers / 1e3 if layers else None,
            "algbw_GBps": nbytes / p["seconds"] / 1e9, "busbw_GBps": nbytes * bus_factor(n) / p["seconds"] / 1e9,
            "bandwidth_bound_us": bound_us, "x_bandwidth_bound": us / bound_us, "correct": p["correct"],
        })
    checks = [{"check": "all-reduce sums", "pass": big["correct"] and all(r["correct"] for r in rows)}]
    return {
        "suite": "allreduce",
        "config": {"world_size": n, "backend": raw["backend"], "dtype": "bfloat16", "tokens": list(task.tokens),
                   "hiddens": list(task.hiddens), "iters": task.iters, "repeats": task.repeats,
                   "warmups": task.warmups, "all_reduces_per_layer": ALL_REDUCES_PER_LAYER,
                   "smoke": device_type != "cuda"},
        "environment": common.environment(torch.device(device_type)),
        "bandwidth": {"bytes": big["bytes"], "us": 1e6 * big["seconds"], "algbw_GBps": algbw / 1e9,
                      "busbw_GBps": busbw / 1e9},
        "rows": rows, "checks": checks,
    }


def summary(result: dict[str, Any]) -> str:
    cfg, bw = result["config"], result["bandwidth"]
    lines = [f"allreduce: {cfg['world_size']} ranks ({cfg['backend']}), BF16; {bw['bytes'] / 2**20:.0f} MiB: "
             f"{bw['us']:.0f} us, algorithm {bw['algbw_GBps']:.1f} GB/s, bus {bw['busbw_GBps']:.1f} GB/s",
             f"{'hidden':>6} {'tokens':>6} {'KiB':>7} {'us/AR':>8} {'us/layer':>9} {'ms/step':>8} {'bus GB/s':>9} "
             f"{'x bw-bound':>10}"]
    for r in result["rows"]:
        step = f"{r['ms_per_decode_step']:8.3f}" if r["ms_per_decode_step"] is not None else f"{'-':>8}"
        lines.append(f"{r['hidden']:>6} {r['tokens']:>6} {r['bytes'] / 1024:7.1f} {r['us_per_allreduce']:8.2f} "
                     f"{r['us_per_layer']:9.2f} {step} {r['busbw_GBps']:9.2f} {r['x_bandwidth_bound']:10.1f}")
    lines += [f"{'PASS' if c['pass'] else 'FAIL'}  check: {c['check']}" for c in result["checks"]]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for hidden in result["config"]["hiddens"]:
        rows = [r for r in result["rows"] if r["hidden"] == hidden]
        tokens = [r["tokens"] for r in rows]
        line = ax.plot(tokens, [r["us_per_layer"] for r in rows], marker="o", label=f"hidden {hidden}: measured")
        ax.plot(tokens, [ALL_REDUCES_PER_LAYER * r["bandwidth_bound_us"] for r in rows], linestyle="--",
                color=line[0].get_color(), label=f"hidden {hidden}: at the measured bus bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (tokens)")
    ax.set_ylabel("us per layer (2 all-reduces)")
    bw = result["bandwidth"]
    ax.set_title(f"all-reduce per layer, {result['config']['world_size']} ranks, bus {bw['busbw_GBps']:.0f} GB/s "
                 f"({result['environment'].get('gpu')})", fontsize=9)
    ax.legend(fontsize=7)
    return common.save_figure(plt, fig, path)


# ------------------------------------------------------------------------------------------------ entry


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="ranks (GPUs; CPU processes with --smoke)")
    p.add_argument("--tokens", default="1,8,32,64,128,256", help="comma-separated decode batch sizes")
    p.add_argument("--hidden", default="4096,8192", help="comma-separated hidden sizes")
    p.add_argument("--iters", type=int, default=200, help="all-reduces per timed loop")
    p.add_argument("--repeats", type=int, default=5, help="timed loops per point (median)")
    p.add_argument("--warmups", type=int, default=2, help="untimed loops per point")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the all-reduce that measures bandwidth")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are stopped")
    p.add_argument("--result-file", type=Path, default=None, help="write the JSON here (and the PNG beside it)")
    p.add_argument("--smoke", action="store_true", help="gloo on the CPU with tiny sizes: checks the script only")


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "allreduce", "all-reduce time per layer at decode batch sizes vs bus bandwidth",
                          add_arguments, run)


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        device_type = "cpu"
    else:
        device_type = "cuda"
        if not torch.cuda.is_available() or torch.cuda.device_count() < args.world_size:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ConfigError(f"invalid --world-size={args.world_size}: this machine has {count} GPU(s); use "
                              "--smoke for the CPU check")
    task = Task(world_size=args.world_size, device_type=device_type, init_method=f"tcp://127.0.0.1:{free_port()}",
                tokens=tuple(int(t) for t in args.tokens.split(",")),
                hiddens=tuple(int(h) for h in args.hidden.split(",")), iters=args.iters, repeats=args.repeats,
                warmups=args.warmups, bandwidth_bytes=args.bandwidth_mib * 2**20, timeout_s=args.timeout)
    raw = run_ranks(task, args.timeout)
    result = build_result(raw, task, device_type)
    common.report(result, summary(result), args.result_file, plot)
    return 0 if all(c["pass"] for c in result["checks"]) else 1


def main(argv: list[str] | None = None) -> int:
    return standalone_main("allreduce", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
