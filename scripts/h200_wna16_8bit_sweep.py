"""W8A16 tiles on the GPU: int8 and FP8-e4m3 weights in groups of 128 (the block-FP8 checkpoints' weight-only
layout and W8A16 group 128), bf16 activations, Llama-3-8B's four linears, M = 1 .. 4096. Every config of an 8-bit
grid (the FMA path at block_m 1, the plain and transposed tensor-core tiles at block_m >= 16, several splits, the
dense path for prompts) is checked against the float64 product, then timed as CUDA-graph replays over weight
copies rotated past L2 (`h200_wna16_sweep.measure`), beside cuBLAS BF16 and the entry the package picks today.

Writes OUT/wna16-8bit-sweep.json (every timing, the best config per (type, shape, M)) and OUT/wna16-8bit-entries.json
(the best configs as "N,K,TYPE" table entries, `wna16.table_key`: merge them into kestrel/kernels/tuning/ once read).

    PYTHONPATH=. python scripts/h200_wna16_8bit_sweep.py --out OUT [--types int8,fp8_e4m3] [--ms 1,4,16,64]
    PYTHONPATH=. python scripts/h200_wna16_8bit_sweep.py --out OUT --dry-run   # CPU interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DRY_SHAPES = {"a": (64, 256)}
GROUP = 128
M_ORDER = [1, 16, 4, 64, 8, 32, 2, 128, 256, 1024, 4096]
SPLITS = (2, 4, 8, 16)


def grid(M: int, wq) -> list:
    """8-bit configs at M (split_k 0: from the SM count; the fastest few are retried with `SPLITS`)."""
    C = wq.WNA16Config
    out = []
    if M <= 4:
        out += [C(1, bn, bk, 0, 1, warps, 4) for bn, bk, warps in
                ((32, 128, 4), (64, 64, 4), (64, 128, 4), (128, 64, 4), (32, 256, 4), (64, 128, 8))]
    if M <= 16:
        for swap in (False, True):
            out += [C(16, bn, bk, 0, 1, warps, stages, swap_ab=swap) for bn, bk, warps, stages in
                    ((32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 4), (64, 128, 4, 6), (128, 128, 8, 4),
                     (64, 64, 4, 4))]
    elif M <= 64:
        bm = 32 if M <= 32 else 64
        for swap in (False, True):
            out += [C(bm, bn, bk, 0, 1, warps, 4, swap_ab=swap) for bn, bk, warps in
                    ((64, 128, 4), (128, 128, 4), (128, 64, 4), (128, 128, 8))]
    else:
        for swap in (False, True):
            out += [C(bm, bn, bk, 1, 8, warps, stages, swap_ab=swap) for bm, bn, bk, warps, stages in
                    ((64, 128, 64, 8, 3), (64, 128, 128, 8, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3),
                     (128, 128, 128, 8, 3))]
        out.append(C(64, 64, 64, 1, 8, 4, 3, dense=True))  # the weight written out, then cuBLAS
    return out


def weight(N: int, K: int, weight_type: str, seed: int, device: str):
    """Random 8-bit codes with bf16 group scales (products of order one)."""
    import torch

    from kestrel.kernels import wna16 as wq

    g = torch.Generator(device=device).manual_seed(seed)
    scales = (torch.rand(N, K // GROUP, generator=g, device=device) + 0.5) / (64.0 * K**0.5)
    if weight_type == "int8":
        values = torch.randint(-127, 128, (N, K), generator=g, device=device, dtype=torch.int32).to(torch.int8)
    else:
        values = (torch.randn(N, K, generator=g, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    return wq.pack_wna16(values, scales.to(torch.bfloat16), weight_type=weight_type)


def label(cfg) -> str:
    if cfg.block_m == 1:
        return "fma"
    if cfg.dense:
        return "dense"
    return "swap1" if cfg.swap_ab else "tc"


def run(args) -> dict:
    import h200_wna16_sweep as sweep
    import torch
    import tune_wna16_moe as tune

    from kestrel.kernels import wna16 as wq

    dev = "cpu" if args.dry_run else "cuda"
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    started = time.time()

    time_calls = sweep.call_timer(args.dry_run)

    result = {"rows": [], "best": {}, "skipped": [], "device": args.device, "group": GROUP,
              "note": "8-bit weights in groups of 128, bf16 activations; CUDA-graph replays over weight copies "
                      "rotated past L2, cuBLAS BF16 over rotated BF16 copies; every config checked against the "
                      "float64 product first"}
    for weight_type in args.types:
        for name, (N, K) in shapes.items():
            copies = 1 if args.dry_run else max(1, min(8, math.ceil(tune.L2_BYTES / (N * K))))
            weights = [weight(N, K, weight_type, seed, dev) for seed in range(copies)]
            dense64 = wq.dequantize_wna16(*weights[0]).double()
            bf16_copies = 1 if args.dry_run else max(1, min(8, math.ceil(tune.L2_BYTES / (N * K * 2))))
            bf16 = [dense64.to(torch.bfloat16) for _ in range(bf16_copies)]
            for M in args.ms:
                if time.time() - started > args.max_seconds:
                    result["skipped"].append(f"{weight_type} {name} M={M}")
                    continue
                x, ref, mm_us = sweep.case_inputs(M, K, dense64, bf16, dev, time_calls)
                case = {"type": weight_type, "shape": name, "N": N, "K": K, "M": M, "bf16_mm_us": mm_us}
                configs = grid(M, wq)
                if args.dry_run:
                    configs = configs[:2]
                cands = [sweep.Candidate("table", wq.select_config(N, K, M, x.device, weight_type))]
                cands += [sweep.Candidate(label(c), c) for c in configs]
                rounded = partial(sweep.check_rounded, abs_ref=x.abs().double() @ dense64.abs().T)
                timed = sweep.measure(case, cands, x, weights, ref, time_calls, check=rounded)
                ranked = sorted((r for r in timed[1:] if "us" in r), key=lambda r: r["us"])[:3]
                retry = [sweep.Candidate(r["variant"], replace(wq.WNA16Config.from_json(r["config"]), split_k=sp))
                         for r in ranked for sp in SPLITS]
                timed += sweep.measure(case, retry[:1] if args.dry_run else retry, x, weights, ref, time_calls,
                                       check=rounded)
                result["rows"] += timed
                fastest = min((r for r in timed if "us" in r), key=lambda r: r["us"], default=None)  # table too
                if fastest is not None:
                    key = wq.table_key(N, K, weight_type)
                    result["best"].setdefault(key, {})[str(M)] = {
                        k: fastest[k] for k in ("us", "bf16_mm_us", "speedup_vs_bf16", "variant", "config")}
                    print(f"{weight_type:8s} {name:8s} M={M:3d}: best {fastest['us']:7.1f} us {fastest['variant']:5s} "
                          f"({fastest['speedup_vs_bf16']:.2f}x bf16 {mm_us:.1f} us; table before "
                          f"{timed[0].get('us', float('nan')):.1f} us) [{time.time() - started:.0f} s]", flush=True)
                result["seconds"] = time.time() - started
                save(args.out, result)
    return result


def save(out: Path, result: dict) -> None:
    (out / "wna16-8bit-sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    entries = {key: {m: e["config"] for m, e in sorted(ms.items(), key=lambda t: int(t[0]))}
               for key, ms in result["best"].items()}
    (out / "wna16-8bit-entries.json").write_text(json.dumps(entries, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--types", default="int8,fp8_e4m3", help="8-bit weight types (comma-separated)")
    parser.add_argument("--ms", default=",".join(map(str, M_ORDER)), help="token counts (comma-separated)")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="stop starting new cases after this")
    args = parser.parse_args()
    args.types = args.types.split(",")
    bad = [t for t in args.types if t not in ("int8", "fp8_e4m3")]
    if bad:
        parser.error(f"--types: {bad} are not 8-bit weight types (int8, fp8_e4m3)")
    args.ms = [int(m) for m in args.ms.split(",")]
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.ms = [1, 16, 64, 128]
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "scripts")]
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry-run)")
    args.device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
