"""Where the prompt compressor's time goes on one GPU (issue 31): `python scripts/h200_compressor_profile.py --out DIR`.

kestrel-tiny compresses held-out text of 8k and 32k of its tokens at rate 0.5, with each `--batches` value (windows
per forward); each point is warmed up once, then timed (median of `--repeats`). One 8k call per batch is profiled:
the top GPU kernels and host ops by self time. Writes DIR/compressor-profile.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kestrel.config import PromptCompressorConfig
from kestrel.entrypoints.prompt_compression import PromptCompressor
from kestrel.sampling_params import PromptCompression
from kestrel.tiny import corpus


def top_ops(profile: torch.profiler.profile, key: str, count: int = 20) -> list[dict]:
    rows = sorted(profile.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:count]
    return [{"name": e.key[:90], "calls": e.count, "self_us": round(getattr(e, key), 1)} for e in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    text = "".join(corpus.texts(corpus.select_evenly(corpus.eval_files(), 400)))
    result: dict = {"device": args.device, "dtype": args.dtype, "points": [], "profiles": {}}
    for batch in [int(b) for b in args.batches.split(",")]:
        compressor = PromptCompressor(PromptCompressorConfig("kestrel-tiny", batch=batch), device=args.device,
                                      dtype=args.dtype)
        ids = compressor.tokenizer.encode(text, add_special_tokens=False)
        for length in [int(n) for n in args.lengths.split(",")]:
            prompt = compressor.tokenizer.decode(ids[:length])
            times = []
            for repeat in range(args.repeats + 1):
                started = time.perf_counter()
                compressor.compress_text(prompt, PromptCompression(0.5))
                if repeat:
                    times.append(time.perf_counter() - started)
            point = {"batch": batch, "tokens": length, "median_ms": round(1e3 * statistics.median(times), 2),
                     "all_ms": [round(1e3 * t, 2) for t in times]}
            print(point, flush=True)
            result["points"].append(point)
        prompt = compressor.tokenizer.decode(ids[:8192])
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            compressor.compress_text(prompt, PromptCompression(0.5))
        result["profiles"][str(batch)] = {
            "gpu": top_ops(profile, "self_device_time_total") if args.device == "cuda" else [],
            "host": top_ops(profile, "self_cpu_time_total")}
        if batch == max(int(b) for b in args.batches.split(",")):
            import cProfile
            import io
            import pstats
            profiler = cProfile.Profile()
            profiler.enable()
            compressor.compress_text(prompt, PromptCompression(0.5))
            profiler.disable()
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
            result["python_profile"] = stream.getvalue()
            print(stream.getvalue())
        compressor.close()
        del compressor
        torch.cuda.empty_cache() if args.device == "cuda" else None
    (args.out / "compressor-profile.json").write_text(json.dumps(result, indent=1))
    for batch, prof in result["profiles"].items():
        print(f"== batch {batch}")
        for kind in ("gpu", "host"):
            for row in prof[kind][:12]:
                print(f"  {kind:4} {row['self_us']:>10.1f} us {row['calls']:>6}  {row['name']}")


if __name__ == "__main__":
    main()
