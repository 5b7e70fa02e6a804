"""Where one long prefill forward's GPU time goes, kernel by kernel: the Llama-3-8B shape with random weights, one
`--prompt`-token sequence (no cached context), eager, per precision (BF16; FP8 + FP8 KV). The forward is timed
(median of 5, synchronized) and profiled once; kernels are grouped by kind (scripts/h200_decode_profile.py's
kinds) and the largest listed. The profile also records the host side: the forward's idle GPU time between kernels
(its largest gaps, with the kernels on either side) and the host calls that wait for the GPU (synchronizations,
device-to-host copies, `.item()`), which would explain a forward longer than its kernels. Writes
OUT/prefill-profile-<gpu>.json.

    PYTHONPATH=$PWD python3 scripts/h200_prefill_profile.py --out OUT --prompt 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200_decode_profile import kind_of  # noqa: E402

from kestrel.bench import common  # noqa: E402
from kestrel.kernels.common import device_name, gpu_key  # noqa: E402
from kestrel.model.attn_metadata import AttentionMetadata  # noqa: E402


def profile_precision(prompt: int, quantization: str | None) -> dict:
    device = torch.device("cuda")
    model_dir, load_format = common.prepare_model(None, "llama3-8b", False, None, False, device)
    engine_args = {"load_format": load_format, "max_model_len": prompt + 64, "max_num_seqs": 4,
                   "max_num_batched_tokens": prompt, "enable_prefix_caching": False}
    if quantization:
        engine_args.update(quantization=quantization, kv_cache_dtype="fp8")
    engine = common.build_engine(model_dir, **engine_args)
    model = engine.runner.model
    block = engine.runner.block_size
    blocks = -(-prompt // block)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(prompt, device=device),
        query_start_loc=torch.tensor([0, prompt], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([prompt], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device).view(1, -1),
        max_query_len=prompt, max_seq_len=prompt)
    ids = torch.randint(0, 1000, (prompt,), device=device)
    positions = torch.arange(prompt, device=device)
    with torch.inference_mode():
        for _ in range(2):
            model(ids, positions, meta)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            model(ids, positions, meta)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(ids, positions, meta)
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name].append(event.device_time / 1e3)
    by_kind: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        by_kind[kind_of(name)] += sum(ms)
    top = sorted(((sum(ms), len(ms), name) for name, ms in kernels.items()), reverse=True)[:20]
    result = {"precision": quantization or "bf16", "prompt": prompt, "forward_ms": statistics.median(times),
              "kernel_ms": sum(by_kind.values()), "by_kind_ms": dict(by_kind),
              "top": [{"ms": ms, "launches": n, "name": name[:160]} for ms, n, name in top],
              **host_side(prof)}
    print(f"{result['precision']} prompt {prompt}: forward {result['forward_ms']:.2f} ms, kernels "
          f"{result['kernel_ms']:.2f} ms", flush=True)
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:14s} {ms:8.2f} ms", flush=True)
    for row in result["top"]:
        print(f"    {row['ms']:8.2f} ms {row['launches']:4d}x {row['name'][:110]}", flush=True)
    print(f"  idle between kernels {result['idle_ms']:.2f} ms; waits on the GPU: {result['host_waits']}; first kernel "
          f"{result['first_kernel_after_ms']:.2f} ms after the forward's first host event", flush=True)
    for row in result["host_self_ms_top"]:
        print(f"    host {row['ms']:8.2f} ms {row['calls']:5d}x {row['name'][:90]}", flush=True)
    for gap in result["largest_gaps"][:8]:
        print(f"    gap {gap['us']:9.1f} us after {gap['after'][:50]} before {gap['before'][:50]}", flush=True)
    del engine, model
    torch.cuda.empty_cache()
    return result


# Host calls that block until the GPU has caught up (or copy from it), by the names the profiler records them under.
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "aten::item",
          "aten::_local_scalar_dense")


def host_side(prof) -> dict:
    """Idle GPU time between the profiled forward's kernels, its largest gaps, and the host's waits on the GPU."""
    launches = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                      key=lambda e: e.time_range.start)
    gaps = []
    for before, after in zip(launches, launches[1:]):
        idle = after.time_range.start - max(before.time_range.end, before.time_range.start)
        if idle > 0:
            gaps.append({"us": idle, "after": before.name[:120], "before": after.name[:120]})
    waits: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(_WAITS):
            waits[e.name][0] += 1
            waits[e.name][1] += e.cpu_time_total / 1e3
    host = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    forward_start = min(e.time_range.start for e in host)
    host_self: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # per operator: calls, self milliseconds
    for e in host:
        host_self[e.name][0] += 1
        host_self[e.name][1] += e.self_cpu_time_total / 1e3
    return {"first_kernel_after_ms": (launches[0].time_range.start - forward_start) / 1e3,
            "host_span_ms": (max(e.time_range.end for e in host) - forward_start) / 1e3,
            "host_self_ms_top": [{"name": n[:120], "calls": c, "ms": round(ms, 3)} for n, (c, ms) in
                                 sorted(host_self.items(), key=lambda kv: -kv[1][1])[:15]],
            "idle_ms": sum(g["us"] for g in gaps) / 1e3,
            "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:20],
            "host_waits": {name: {"calls": n, "ms": round(ms, 3)} for name, (n, ms) in waits.items()}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--precisions", default="fp8,bf16")
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(0), "runs": []}
    out_file = Path(args.out) / f"prefill-profile-{gpu_key(device_name(0))}.json"
    for precision in args.precisions.split(","):
        results["runs"].append(profile_precision(args.prompt, None if precision == "bf16" else precision))
        out_file.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
