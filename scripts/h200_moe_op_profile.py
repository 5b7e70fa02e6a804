"""Where one fused MoE op's time goes, kernel by kernel: `PYTHONPATH=. python3 scripts/h200_moe_op_profile.py --out OUT
[--tokens 32,128] [--shape qwen3-30b-a3b] [--align-max-pairs N]`. Builds the layer as `kestrel bench moe` does (random
experts, uniform routing), BF16 and FP8 (per channel, [128, 128] blocks), and records the CUDA kernels of 20 calls
under the torch profiler, weights rotated over `kestrel bench moe`'s copies; writes OUT/moe-op-profile-<gpu>.json.
`--align-max-pairs N` moves the single-program alignment's limit (T = 256, 512 with 4096 against the default shows
whether it beats the torch sort there)."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kestrel.bench import moe as bench
from kestrel.kernels import moe_routing as routing
from kestrel.kernels.common import device_name, gpu_key

CALLS = 20


def profile_point(ctx: bench.Ctx, shape: bench.Shape, layers: list, T: int) -> dict:
    batches = bench.make_batches(ctx, shape, layers, "uniform", T)
    calls = [lambda b=b: bench.fused_call(ctx, layers[b.layer], b) for b in batches]
    for call in calls:  # compile and warm
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            calls[i % len(calls)]()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += e.device_time / CALLS
            kernels[e.name][1] += 1
    rows = sorted(({"name": n[:120], "us_per_call": round(v[0], 2), "launches_per_call": v[1] / CALLS}
                   for n, v in kernels.items()), key=lambda r: -r["us_per_call"])
    return {"T": T, "kernel_us_per_call": round(sum(r["us_per_call"] for r in rows), 2), "kernels": rows,
            "weight_bytes": sum(b.counted["weight_bytes"] for b in batches) / len(batches)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="32,128")
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--align-max-pairs", type=int, default=None,
                        help="steps of up to this many (token, expert) pairs take the single-program alignment "
                             f"(default {routing.ALIGN_SINGLE_MAX_PAIRS}); above it the torch sort")
    args = parser.parse_args()
    if args.align_max_pairs is not None:
        routing.ALIGN_SINGLE_MAX_PAIRS = args.align_max_pairs
    device = torch.device("cuda")
    shape = bench.parse_shapes([args.shape], False)[0]
    tokens = bench.parse_ints(args.tokens, "--tokens")
    result = {"gpu": torch.cuda.get_device_name(0), "shape": shape.name, "runs": []}
    out_file = Path(args.out) / f"moe-op-profile-{gpu_key(device_name(0))}.json"
    for dtype, block in (("bf16", None), ("fp8", None), ("fp8", (128, 128))):
        ctx = bench.Ctx(device=device, dtype=dtype, fp8_block=block, runs=bench.MIN_GPU_RUNS, routings=("uniform",),
                        batches=tokens, anchors=(), zipf_s=1.0, seed=0, ceilings={})
        layers = bench.make_layers(ctx, shape, bench.layer_count(ctx, shape))
        for T in tokens:
            run = {"weights": dtype if block is None and dtype == "bf16" else f"fp8-{'block' if block else 'channel'}",
                   **profile_point(ctx, shape, layers, T)}
            result["runs"].append(run)
            print(f"{run['weights']} T={T}: {run['kernel_us_per_call']} us of kernels", flush=True)
            for r in run["kernels"]:
                print(f"    {r['us_per_call']:8.2f} us {r['launches_per_call']:4.1f}x {r['name']}", flush=True)
            out_file.write_text(json.dumps(result, indent=1))
        del layers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
