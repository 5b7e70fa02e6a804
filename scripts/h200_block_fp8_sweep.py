"""Tiles of the W8A8 block GEMM (`kernels/block_fp8_mm.py`) on the GPU: for Llama-3-8B's four linears in [128, 128]
blocks and each M, a grid of `BlockMMConfig`s is checked against the float64 product of the same e4m3 operands and
their scales, then timed as CUDA-graph replays over weights rotated past L2 (`h200_block_fp8_mm.timed`), beside the
config the package picks today. Writes OUT/block-fp8-sweep.json (every timing and the best config per shape and M)
and OUT/block_fp8_mm_<gpu>.json (a tuning table of the best configs: copy it into kestrel/kernels/tuning/ once read).

    PYTHONPATH=. python3 scripts/h200_block_fp8_sweep.py --out OUT [--ms 4096,256,1024,64,16,8192,1] [--max-seconds 300]
    PYTHONPATH=. python3 scripts/h200_block_fp8_sweep.py --out OUT --dry-run   # CPU interpreter, one small shape
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DRY_SHAPES = {"small": (256, 384)}
GROUP = 128
M_ORDER = [4096, 256, 1024, 64, 16, 8192, 1]


def grid(M: int, dry_run: bool) -> list:
    """The configs tried at M: row tiles near M's size, three column tiles, 4 or 8 warps, 3 or 4 stages."""
    from kestrel.kernels.block_fp8_mm import BlockMMConfig

    block_ms = [16] if M <= 16 else [16, 32, 64] if M <= 64 else [32, 64, 128] if M <= 256 else [64, 128]
    configs = [BlockMMConfig(bm, bn, warps, stages, 1 if M <= 64 else 8)
               for bm in block_ms for bn in (64, 128, 256) for warps in (4, 8) for stages in (3, 4)]
    return configs[:2] if dry_run else configs


def oracle(a, b, scale_a, scale_b):
    """float64: every e4m3 value times its group's scale, then the product."""
    K = a.shape[1]
    sa = scale_a.double().repeat_interleave(GROUP, 1)[:, :K]
    sb = scale_b.double().repeat_interleave(GROUP, 1)[:, :K]
    return (a.double() * sa) @ (b.double() * sb).T, (a.double().abs() * sa) @ (b.double().abs() * sb).T


def run(args) -> dict:
    import torch
    from h200_block_fp8_mm import block_weight, timed

    from kestrel import ops
    from kestrel.kernels import block_fp8_mm as bm

    dev = "cpu" if args.dry_run else "cuda"
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    gen = torch.Generator(device=dev).manual_seed(0)
    started = time.time()
    result = {"rows": [], "best": {}, "skipped": [], "group": GROUP,
              "device": "cpu" if args.dry_run else torch.cuda.get_device_name(),
              "note": "e4m3 activations per token and 128 features, e4m3 weights in [128, 128] blocks, bf16 out; "
                      "every config checked against the float64 product first; CUDA-graph replays over weights "
                      "rotated past L2"}
    for name, (N, K) in shapes.items():
        copies = 1 if args.dry_run else max(2, int(4e8 // (N * K)))
        weights = [block_weight(N, K, gen) for _ in range(copies)]
        for M in args.ms:
            if time.time() - started > args.max_seconds:
                result["skipped"].append(f"{name} M={M}")
                continue
            x = [torch.randn(M, K, generator=gen, device=dev).to(torch.bfloat16) for _ in range(copies)]
            quant = [ops.quant_fp8_per_group(xi, GROUP) for xi in x]
            want, magnitude = oracle(quant[0][0], weights[0][0], quant[0][1], weights[0][1])
            table = bm.select_config(N, K, M, torch.device(dev))
            rows = []
            for variant, cfg in [("table", table)] + [("grid", c) for c in grid(M, args.dry_run)]:
                row = {"shape": name, "N": N, "K": K, "M": M, "variant": variant, "config": cfg.to_json()}
                try:
                    got = bm.block_fp8_mm(quant[0][0], weights[0][0], quant[0][1], weights[0][1], GROUP,
                                          torch.bfloat16, config=cfg)
                    excess = ((got.double() - want).abs() - (2.0**-8 * want.abs() + 2.0**-12 * magnitude)).max()
                    if excess > 0:
                        raise ValueError(f"wrong result: {excess.item():.3g} past the bound")
                    if not args.dry_run:
                        row["us"] = timed(lambda i, c=cfg, q=quant, w=weights: bm.block_fp8_mm(
                            q[i][0], w[i][0], q[i][1], w[i][1], GROUP, torch.bfloat16, config=c), copies)
                except Exception as exc:  # resources this tile cannot get: logged, skipped
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
            result["rows"] += rows
            timed_rows = [r for r in rows if "us" in r]
            if timed_rows:
                best = min(timed_rows, key=lambda r: r["us"])
                before = next((r["us"] for r in rows if r["variant"] == "table" and "us" in r), None)
                result["best"].setdefault(f"{N},{K}", {})[str(M)] = {"us": best["us"], "table_us": before,
                                                                     "config": best["config"]}
                print(f"{name:8s} M={M:5d}: best {best['us']:8.1f} us {best['config']} (table {before:.1f} us) "
                      f"[{time.time() - started:.0f} s]", flush=True)
            result["seconds"] = time.time() - started
            save(args.out, result)
    return result


def save(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "block-fp8-sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    configs = {shape: {m: entry["config"] for m, entry in sorted(ms.items(), key=lambda t: int(t[0]))}
               for shape, ms in result["best"].items()}
    from kestrel.kernels.common import gpu_key

    gpu = gpu_key(result["device"])
    table = {"gpu": gpu, "note": "Measured by scripts/h200_block_fp8_sweep.py: " + result["note"], "configs": configs}
    (out / f"block_fp8_mm_{gpu}.json").write_text(json.dumps(table, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ms", default=",".join(map(str, M_ORDER)), help="token counts, in the order run")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="stop starting new cases after this")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, one small shape")
    args = parser.parse_args()
    args.ms = [int(m) for m in args.ms.split(",")]
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.ms = [1, 70]
    sys.path.insert(0, str(Path(__file__).parent))
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
