"""Where a decode step's time goes on the GPU: kernels per step, their GPU time, and the step's wall time.

    python scripts/profile_decode.py --layers 4 --batch 1,64 --context 512 --out DIR

Builds the Llama-3-8B architecture with `--layers` decoder layers (random weights), for each precision and
batch size prefills `batch` prompts of `--context` tokens, then times `--steps` decode steps (host wall time
with a device synchronize on each side, CUDA graphs unless --enforce-eager) and profiles a few more with
torch.profiler. Writes DIR/profile-decode.json: per point the median step, the kernels summed by name
(launches and GPU microseconds per step), and the step's GPU-busy fraction.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kestrel.bench import common
from kestrel.sampling_params import SamplingParams


def build(layers: int, quantization: str | None, kv_cache_dtype: str, max_batch: int, context: int,
          enforce_eager: bool, workdir: Path) -> common.Engine:
    config = {**common.LLAMA3_8B, "num_hidden_layers": layers}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(config))
    return common.build_engine(str(workdir), dtype="bfloat16", device="cuda", load_format="dummy",
                               quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                               enforce_eager=enforce_eager, enable_prefix_caching=False, max_num_seqs=max_batch,
                               max_num_batched_tokens=max(8192, max_batch), max_model_len=context + 512,
                               gpu_memory_utilization=0.85)


def decode_steps(engine: common.Engine, batch: int, context: int, steps: int, profile_steps: int,
                 tag: str) -> dict[str, Any]:
    core = engine.core
    params = SamplingParams(max_tokens=steps + profile_steps + 8, temperature=0.0, ignore_eos=True,
                            output_kind="final_only")
    for i, prompt in enumerate(common.random_prompts(batch, context, 128256, seed=batch)):
        core.add_request(f"{tag}-{i}", prompt, params)
    while any(len(r.output_token_ids) == 0 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    for _ in range(3):
        core.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profile_steps):
            core.step()
        torch.cuda.synchronize()
    while core.has_unfinished_requests():
        core.step()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[evt.name[:90]]
            entry[0] += 1
            entry[1] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    per_step = sorted(((name, n / profile_steps, us / profile_steps) for name, (n, us) in kernels.items()),
                      key=lambda x: -x[2])
    gpu_us = sum(us for _, _, us in per_step)
    step_ms = 1e3 * common.median(times)
    return {"batch": batch, "context": context, "step_ms": step_ms, "step_p90_ms": 1e3 * common.percentile(times, 0.9),
            "gpu_busy_us_per_step": gpu_us, "launches_per_step": sum(n for _, n, _ in per_step),
            "gpu_busy_fraction": gpu_us / (1e3 * step_ms),
            "kernels": [{"name": n, "per_step": c, "us_per_step": round(us, 2)} for n, c, us in per_step]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", default="1,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--precisions", default="bf16,fp8", help="bf16, fp8 (W8A8-FP8 + FP8 KV), fp8-bf16kv")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    settings = {"bf16": (None, "auto"), "fp8": ("fp8", "fp8"), "fp8-bf16kv": ("fp8", "auto")}
    results = []
    for precision in args.precisions.split(","):
        quantization, kv = settings[precision]
        engine = build(args.layers, quantization, kv, max(batches), args.context, args.enforce_eager,
                       Path("/tmp/kestrel-profile-decode"))
        for batch in batches:
            row = decode_steps(engine, batch, args.context, args.steps, args.profile_steps, f"{precision}-{batch}")
            row.update(precision=precision, layers=args.layers, enforce_eager=args.enforce_eager,
                       launches_per_layer_per_step=row["launches_per_step"] / args.layers)
            results.append(row)
            print(f"{precision:>10} batch {batch:>4}: step {row['step_ms']:.3f} ms, GPU busy "
                  f"{row['gpu_busy_us_per_step']:.0f} us ({row['gpu_busy_fraction']:.0%}), "
                  f"{row['launches_per_step']:.0f} launches", flush=True)
            for k in row["kernels"][:12]:
                print(f"    {k['per_step']:6.1f} x {k['us_per_step']:9.1f} us  {k['name']}")
        common.release(engine)
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"environment": common.environment(torch.device("cuda")), "results": results}
    (args.out / "profile-decode.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
