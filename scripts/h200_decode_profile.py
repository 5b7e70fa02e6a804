"""Where a small-batch decode step's GPU time goes, kernel by kernel: one engine per precision (random weights of
`--arch`, CUDA graphs as the engine captures them), `--batch` requests of `--prompt` tokens prefilled, then
`--steps` decode steps timed (host wall time per step) and `--profile-steps` more under torch.profiler.

Kernels are grouped by a coarse kind from their names (MoE experts, MoE routing, GEMM, attention, norm / RoPE /
activation, quantization, sampler / other) and listed with their time per step; the step's wall time is set
against the sum, so the gap is the time the GPU idles. Writes OUT/decode-profile-<arch>-<tag>.json.

    PYTHONPATH=. python scripts/h200_decode_profile.py --out OUT --arch qwen3-30b-a3b --tag table
    PYTHONPATH=. python scripts/h200_decode_profile.py --out OUT --smoke     # CPU check of this script

Under programmatic dependent launch the profiler charges each kernel its wait for the one before (a GEMV shows
30 us a call): `--no-pdl` launches every kernel without it, so the step is slower but splits by kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.bench import common  # noqa: E402
from kestrel.sampling_params import SamplingParams  # noqa: E402

KINDS = (("moe_experts", ("fused_moe", "moe_small_t", "_moe_", "moe_gemm", "small_t")),
         ("moe_routing", ("route", "align", "topk", "moe_sum")),
         ("attention", ("attention", "attn", "flash", "paged")),
         ("quant", ("quant", "fp8_act", "per_token")),
         ("gemm", ("gemm", "gemv", "scaled_mm", "matmul", "cutlass", "sm90", "nvjet", "xmma", "cublas", "wna16")),
         ("norm_rope_act", ("norm", "rope", "rotary", "silu", "act", "store_kv")),
         )


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, keys in KINDS:
        if any(k in lowered for k in keys):
            return kind
    return "other"


def profile_precision(args: argparse.Namespace, quantization: str | None, kv_dtype: str) -> dict[str, Any]:
    device = torch.device("cpu" if args.smoke else "cuda")
    model_dir, load_format = common.prepare_model(None, args.arch, args.smoke, None, False, device, args.weight_only)
    engine = common.build_engine(model_dir, dtype="float32" if args.smoke else "bfloat16", device=device.type,
                                 load_format=load_format, quantization=quantization, kv_cache_dtype=kv_dtype,
                                 enable_prefix_caching=False, max_num_seqs=max(args.batch, 1),
                                 max_model_len=args.prompt + args.steps + args.profile_steps + 64)
    core = engine.core
    vocab = common.prompt_vocab(model_dir)
    gen = torch.Generator().manual_seed(0)
    total = args.steps + args.profile_steps + 8
    params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(f"p-{i}", torch.randint(1, vocab, (args.prompt,), generator=gen).tolist(), params)
    for _ in range(4):  # prefill, then warm decode steps
        core.step()
    common.synchronize(engine.runner.device)
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        core.step()
        common.synchronize(engine.runner.device)
        walls.append((time.perf_counter() - t0) * 1e3)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            core.step()
        common.synchronize(engine.runner.device)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if device.type == "cuda" and evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device.type == "cpu" and evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        dur = evt.device_time if device.type == "cuda" else evt.cpu_time
        per_kernel[evt.name][0] += dur / args.profile_steps
        per_kernel[evt.name][1] += 1
    kinds: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        kinds[kind_of(name)] += us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:30]
    gpu_us = sum(v[0] for v in per_kernel.values())
    step_ms = statistics.median(walls)
    result = {"quantization": quantization, "kv_cache_dtype": kv_dtype, "batch": args.batch, "prompt": args.prompt,
              "step_ms_median": step_ms, "step_ms_all": walls, "gpu_kernel_us_per_step": gpu_us,
              "idle_us_per_step": step_ms * 1e3 - gpu_us, "kinds_us_per_step": dict(kinds),
              "top_kernels": [{"name": n[:160], "us_per_step": us, "calls_per_step": c / args.profile_steps}
                              for n, (us, c) in top],
              "graph_capture_s": getattr(engine.runner, "graph_capture_s", None)}
    common.release(engine)
    return result


def _without_pdl(x: torch.Tensor, feature: str | None = None) -> dict:
    """`kernels.common.pdl_options` with PDL off for every launch (`--no-pdl`)."""
    return {"USE_PDL": False, "launch_pdl": False} if x.is_cuda else {"USE_PDL": False}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", default="qwen3-30b-a3b", choices=sorted(common.ARCHS))
    p.add_argument("--tag", default="default", help="names the result file (e.g. which tuning tables were in place)")
    p.add_argument("--precisions", default="bf16,fp8", help="comma-separated: bf16, fp8 (FP8 weights + FP8 KV)")
    p.add_argument("--weight-only", default=None, choices=[*sorted(common.WEIGHT_ONLY_BITS), *common.GGUF_MIXES],
                   help="a random weight-only checkpoint or GGUF file of --arch (with --precisions bf16)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny random llama on the CPU: checks this script runs")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch every kernel without programmatic dependent launch: under PDL the profiler charges a "
                        "kernel its wait for the one before, so only a step without it splits by kernel")
    args = p.parse_args(argv)
    if args.no_pdl:
        from kestrel.kernels import common as kernel_common

        kernel_common.pdl_options = _without_pdl
    args.out.mkdir(parents=True, exist_ok=True)
    choices = {"bf16": (None, "auto"), "fp8": ("fp8", "fp8")}
    results = {}
    for name in args.precisions.split(","):
        quantization, kv = choices[name]
        res = profile_precision(args, quantization, "auto" if args.smoke else kv)
        results[name] = res
        print(f"== {args.arch} {name} batch {args.batch}: step {res['step_ms_median']:.3f} ms, "
              f"GPU kernels {res['gpu_kernel_us_per_step']:.0f} us, idle {res['idle_us_per_step']:.0f} us")
        for kind, us in sorted(res["kinds_us_per_step"].items(), key=lambda kv: -kv[1]):
            print(f"   {kind:16s} {us:9.1f} us")
        for row in res["top_kernels"][:20]:
            print(f"   {row['us_per_step']:9.1f} us  x{row['calls_per_step']:5.0f}  {row['name'][:100]}")
    path = args.out / f"decode-profile-{args.arch}-{args.tag}.json"
    path.write_text(json.dumps({"arch": args.arch, "tag": args.tag, "pdl": not args.no_pdl, "results": results},
                               indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
