"""Offline tuning of the weight-only GEMM (`kernels/wna16.py`) on this GPU: every candidate config is checked
against the first one's output, timed as CUDA-graph replays over weight copies rotated past L2, and the fastest per
(shape, M bucket) goes to the per-GPU table `wna16_<gpu>.json` under OUT (copy it to kestrel/kernels/tuning/), with
every timing in OUT/tune-<gpu>.json. The fused MoE kernel's table is tuned by scripts/tune_fused_moe.py.

    python scripts/tune_wna16_moe.py --out OUT [--kernels wna16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.kernels import common  # noqa: E402
from kestrel.kernels import wna16 as wq  # noqa: E402

# (N, K) of Llama-3-8B's linears (qkv, o, gate_up, down), W4A16 group 128.
WNA16_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
WNA16_M = [1, 4, 16, 64, 256]
L2_BYTES = 3 * 60 * 2**20


def time_us(calls: list, rep_ms: int = 40) -> float:
    """Median per call of replays of one CUDA graph calling each of `calls` once, over about `rep_ms` of replays."""
    import triton

    for c in calls:
        c()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=rep_ms, return_mode="median") * 1e3 / len(calls)


def wna16_grid(M: int) -> list[wq.WNA16Config]:
    """Tensor-core tiles at every M; up to M = 16 also the FMA path (block_m 1: one program per activation row)."""
    if M <= 16:
        gemv = [wq.WNA16Config(1, bn, bk, 0, 1, warps, stages)
                for bn, bk, warps, stages in itertools.product((64, 128, 256), (128, 256), (4, 8), (3, 4))]
        space = itertools.product((16,), (64, 128), (128, 256), (0,), (False, True), ((4, 4),))
    elif M <= 64:
        gemv = []
        space = itertools.product((64,), (64, 128), (64, 128), (0,), (False, True), ((4, 4),))
    else:
        gemv = []
        space = itertools.product((64,), (128, 256), (64, 128), (1,), (False,), ((8, 3),))
    return gemv + [wq.WNA16Config(bm, bn, bk, split, 1 if M <= 64 else 8, warps, stages, nibbles)
                   for bm, bn, bk, split, nibbles, (warps, stages) in space]


def int4_weight(N: int, K: int, seed: int, device: str = "cuda") -> wq.WNA16Weight:
    g = torch.Generator(device=device).manual_seed(seed)
    values = torch.randint(-8, 8, (N, K), generator=g, device=device)
    scales = ((torch.rand(N, K // 128, generator=g, device=device) + 0.5) / (5.0 * K**0.5)).to(torch.bfloat16)
    return wq.pack_wna16(values, scales, weight_type="int4")


def tune_wna16(log: list[dict]) -> dict:
    table: dict[str, dict] = {}
    for N, K in WNA16_SHAPES:
        copies = max(1, min(8, math.ceil(L2_BYTES / (N * K // 2))))
        weights = [int4_weight(N, K, seed) for seed in range(copies)]
        entries = table.setdefault(f"{N},{K}", {})
        for M in WNA16_M:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            dense = wq.dequantize_wna16(*weights[0]).to(torch.bfloat16)
            mm_us = time_us([lambda: torch.mm(x, dense.T)])  # noqa: B023
            expected = wq.wna16_gemm(x, *weights[0], torch.bfloat16, config=wq.WNA16Config(16, 64, 64, 1))
            best = None
            for cfg in wna16_grid(M):
                try:
                    out = wq.wna16_gemm(x, *weights[0], torch.bfloat16, config=cfg)
                    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
                    if not err < 1e-2:
                        raise ValueError(f"wrong result: relative error {err:.3g}")
                    us = time_us([lambda w=w, c=cfg: wq.wna16_gemm(x, *w, torch.bfloat16, config=c)  # noqa: B023
                                  for w in weights])
                except Exception as exc:  # a config this shape cannot run (resources): skipped, logged
                    log.append({"kernel": "wna16", "N": N, "K": K, "M": M, "config": cfg.to_json(),
                                "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    continue
                log.append({"kernel": "wna16", "N": N, "K": K, "M": M, "config": cfg.to_json(), "us": us,
                            "bf16_mm_us": mm_us, "speedup_vs_bf16": mm_us / us})
                if best is None or us < best[0]:
                    best = (us, cfg)
            if best is not None:
                entries[str(M)] = best[1].to_json()
                print(f"wna16 N={N} K={K} M={M}: best {best[0]:.1f} us, bf16 mm {mm_us:.1f} us "
                      f"({mm_us / best[0]:.2f}x) {best[1]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kernels", default="wna16")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = "".join(ch if ch.isalnum() else "_" for ch in common.device_name(0).lower()).strip("_")
    log: list[dict] = []
    started = time.time()
    for kernel in args.kernels.split(","):
        tune, note = {"wna16": (tune_wna16, "W4A16 int4 group 128, bf16 activations")}[kernel]
        table = tune(log)
        (args.out / f"{kernel}_{gpu}.json").write_text(json.dumps(
            {"gpu": gpu, "note": f"Measured by scripts/tune_wna16_moe.py ({note}): the fastest config per shape "
                                 "and M bucket, CUDA-graph replays over weights rotated past L2.",
             "configs": table}, indent=1) + "\n")
        (args.out / f"tune-{gpu}.json").write_text(json.dumps({"seconds": time.time() - started, "rows": log}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
