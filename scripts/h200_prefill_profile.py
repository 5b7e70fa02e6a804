"""Where one long prefill forward's GPU time goes, kernel by kernel: the Llama-3-8B shape with random weights, one
`--prompt`-token sequence (no cached context), eager, per precision (BF16; FP8 + FP8 KV). The forward is timed
(median of 5, synchronized) and profiled once; kernels are grouped by kind (scripts/h200_decode_profile.py's
kinds) and the largest listed. Writes OUT/prefill-profile-<gpu>.json.

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
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
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
              "top": [{"ms": ms, "launches": n, "name": name[:160]} for ms, n, name in top]}
    print(f"{result['precision']} prompt {prompt}: forward {result['forward_ms']:.2f} ms, kernels "
          f"{result['kernel_ms']:.2f} ms", flush=True)
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:14s} {ms:8.2f} ms", flush=True)
    for row in result["top"]:
        print(f"    {row['ms']:8.2f} ms {row['launches']:4d}x {row['name'][:110]}", flush=True)
    del engine, model
    torch.cuda.empty_cache()
    return result


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
