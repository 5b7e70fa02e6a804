"""Offline tuning of the fused MoE kernel's grouped GEMM (`kernels/fused_moe.py`) on this GPU, per layer shape,
weight kind (16-bit, FP8 per channel, FP8 blocks of [128, 128]) and token bucket.

Every candidate config is compiled ahead in a pool of processes (`kernels/compile_ahead.py`), checked against the
output of the config the GPU's table runs today, and timed as CUDA-graph replays of the whole op (alignment,
activation quantization and k-sum included) over four routings, the small-T path left out. A bucket's entry
changes only where a candidate is at least 3% faster than today's config in the same run; FP8 kinds that had no
entry of their own start from the 16-bit entry they fell back to. The merged table goes to
OUT/fused_moe_<gpu>.json (copy it to kestrel/kernels/tuning/), every timing to OUT/tune-fused-moe-<gpu>.json.

    PYTHONPATH=. python3 scripts/tune_fused_moe.py --out OUT [--kinds fp8_channel,fp8_block] [--tokens 8,32,128]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/tune_fused_moe.py --out OUT --smoke   # CPU check of this script
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import time
from pathlib import Path

import torch

from kestrel.bench.moe import quantize_fp8
from kestrel.bench.timing import time_calls
from kestrel.kernels import common, compile_ahead
from kestrel.kernels.fused_moe import MoEConfig, fused_moe, select_config
from kestrel.kernels.moe_small_t import table_key

# name: (E, k, H, I)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
SMOKE_SHAPES = {"tiny": (8, 2, 64, 32)}
KINDS = ("bf16", "fp8_channel", "fp8_block")
TOKENS = (1, 8, 32, 128, 512)
FP8_BLOCK = (128, 128)
MIN_GAIN = 0.03
ERR_LIMIT = {"bf16": 1e-2, "fp8_channel": 3e-2, "fp8_block": 3e-2}
ROUTINGS = 4
RUNS = 40


def grid(kind: str, T: int, rows_per_expert: float, smoke: bool) -> list[MoEConfig]:
    """Candidates for T tokens: row blocks up to about twice the rows an expert gets, column and K tiles by the
    weight's element size (FP8 blocks fix the first GEMM's columns and both K tiles at 128), a few warp and stage
    counts."""
    if smoke:
        return [MoEConfig(16, 32, 32), MoEConfig(16, 64, 32, num_stages=2)]
    block_ms = [bm for bm in (16, 32, 64, 128) if bm == 16 or bm <= 2 * rows_per_expert]
    block_ns = (64, 128, 256)
    block_ks = {"bf16": (64, 128), "fp8_channel": (128, 256), "fp8_block": (128,)}[kind]
    shapes = ((4, 3), (4, 4), (4, 5), (8, 3), (8, 4))
    return [MoEConfig(bm, bn, bk, 1 if bm == 16 else 8, warps, stages)
            for bm, bn, bk, (warps, stages) in itertools.product(block_ms, block_ns, block_ks, shapes)]


def make_layer(E: int, H: int, inter: int, kind: str, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    w13 = (torch.randn(E, 2 * inter, H, generator=g, device=device) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g, device=device) / math.sqrt(inter)).to(dtype)
    if kind == "bf16":
        return {"w13": w13, "w2": w2}
    block = FP8_BLOCK if kind == "fp8_block" else None
    if block is not None and device.type == "cpu":
        block = (16, 16)
    q13, s13 = quantize_fp8(w13, block)
    q2, s2 = quantize_fp8(w2, block)
    return {"w13": q13, "w2": q2, "w13_scale": s13, "w2_scale": s2, "block_shape": block}


def make_routings(E: int, k: int, H: int, T: int, device: torch.device, seed: int) -> list[tuple]:
    """x and a renormalised softmax top-k routing per set; different experts each set, as in successive layers."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    sets = []
    for _ in range(ROUTINGS):
        x = torch.randn(T, H, generator=g, device=device).to(dtype)
        probs = torch.randn(T, E, generator=g, device=device).softmax(dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        sets.append((x, weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)))
    return sets


def call(layer: dict, routing: tuple, cfg: MoEConfig) -> torch.Tensor:
    x, weights, ids = routing
    scales = {key: layer[key] for key in ("w13_scale", "w2_scale", "block_shape") if key in layer}
    return fused_moe(x, layer["w13"], layer["w2"], weights, ids, config=cfg, small_t=False, **scales)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def tune_point(name: str, shape: tuple, kind: str, T: int, layer: dict, device: torch.device, smoke: bool,
               rows: list[dict]) -> tuple[MoEConfig, float, MoEConfig, float]:
    """(today's config, its us, the chosen config, its us) at T tokens; every candidate's row appended."""
    E, k, H, inter = shape
    routings = make_routings(E, k, H, T, device, seed=T)
    current = select_config(E, inter, H, T, device, kind)
    candidates = list(dict.fromkeys([current, *grid(kind, T, T * k / E, smoke)]))
    expected = call(layer, routings[0], current)
    timed: dict[MoEConfig, float] = {}
    for cfg in candidates:
        row = {"model": name, "kind": kind, "T": T, "config": cfg.to_json(), "current": cfg == current}
        try:
            err = rel_err(call(layer, routings[0], cfg), expected)
            if not err <= ERR_LIMIT[kind]:
                raise ValueError(f"wrong result: relative error {err:.3g}")
            us, graphed = time_calls([functools.partial(call, layer, r, cfg) for r in routings],
                                     2 if smoke else RUNS, device)
        except Exception as exc:  # a config this shape cannot run (resources, a wrong result): logged, skipped
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        timed[cfg] = us
        rows.append({**row, "us": us, "rel_err": err, "graphed": graphed})
    if current not in timed:
        raise RuntimeError(f"{name} {kind} T={T}: today's config {current} failed; see the log")
    best = min(timed, key=timed.get)
    chosen = best if timed[best] < (1 - MIN_GAIN) * timed[current] else current
    return current, timed[current], chosen, timed[chosen]


def warm_compiles(shapes: dict, kinds: list[str], tokens: list[int], device: torch.device, workers: int) -> dict:
    """Every candidate of every point run once dry, its kernels compiled by a pool of `workers` processes."""
    if device.type != "cuda" or workers < 1:
        return {}
    pool = compile_ahead.start_pool(workers)
    forwards = []
    layers = []
    for (E, k, H, inter), kind in itertools.product(shapes.values(), kinds):
        layer = make_layer(E, H, inter, kind, device)
        layers.append(layer)
        for T in tokens:
            routing = make_routings(E, k, H, T, device, seed=T)[0]
            current = select_config(E, inter, H, T, device, kind)
            for cfg in dict.fromkeys([current, *grid(kind, T, T * k / E, False)]):
                forwards.append(functools.partial(call, layer, routing, cfg))
    try:
        stats = compile_ahead.compile_ahead(pool, forwards)
    finally:
        pool.shutdown()
    del layers
    torch.cuda.empty_cache()
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--workers", type=int, default=15, help="compile processes (0: compile at first launch)")
    p.add_argument("--max-seconds", type=float, default=480, help="no new point starts after this")
    p.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (a check of this script)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    kinds = [kind for kind in args.kinds.split(",") if kind]
    if any(kind not in KINDS for kind in kinds):
        p.error(f"--kinds: expected a comma list of {list(KINDS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.models.split(",")}
    gpu = "cpu" if args.smoke else common.gpu_key(common.device_name(0))
    started = time.time()
    result: dict = {"gpu": gpu, "rows": [], "points": [], "compile": {}}
    result["compile"] = warm_compiles(shapes, kinds, tokens, device, args.workers)
    table = dict(common.gpu_table("fused_moe", device))
    log_path = args.out / f"tune-fused-moe-{gpu}.json"
    for (name, shape), kind in itertools.product(shapes.items(), kinds):
        E, _, H, inter = shape
        layer = make_layer(E, H, inter, kind, device)
        key = table_key(E, inter, H, kind)
        # A kind without entries of its own starts from what it ran: the fallback's entries, every bucket.
        entries = dict(table.get(key) or table.get(table_key(E, inter, H, "bf16")) or {})
        for T in tokens:
            if time.time() - started > args.max_seconds:
                print(f"time budget spent: {name} {kind} T={T} and after not tuned", flush=True)
                break
            current, current_us, chosen, chosen_us = tune_point(name, shape, kind, T, layer, device, args.smoke,
                                                                result["rows"])
            entries[str(T)] = chosen.to_json()
            result["points"].append({"model": name, "kind": kind, "T": T, "current": current.to_json(),
                                     "current_us": current_us, "chosen": chosen.to_json(), "chosen_us": chosen_us})
            print(f"{name} {kind} T={T}: {current_us:.1f} -> {chosen_us:.1f} us "
                  f"({current_us / chosen_us:.2f}x) {chosen}", flush=True)
            log_path.write_text(json.dumps({**result, "seconds": time.time() - started}) + "\n")
        table[key] = dict(sorted(entries.items(), key=lambda item: int(item[0])))
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (args.out / f"fused_moe_{gpu}.json").write_text(json.dumps(
        {"gpu": gpu, "note": "Measured by scripts/tune_fused_moe.py per layer shape, weight kind (bf16: 16-bit "
                             "experts) and token bucket: the whole op as CUDA-graph replays over four routings; an "
                             "entry changes only for a config >= 3% faster than the one before it.",
         "configs": table}, indent=1) + "\n")
    log_path.write_text(json.dumps({**result, "seconds": time.time() - started}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
