"""W4A16 (int4, group 128, bf16 activations) kernel variants on the H200: every config of a grid of tiles x
variants (`WNA16Config`: the FMA path with its load pipelines, the nibble dots with `fast_convert` and `swap_ab`,
the plain tensor-core tiles) is first checked against the float64 product, then timed as CUDA-graph replays over
weight copies rotated past L2 (`tune_wna16_moe.time_us`), at M = 1 .. 256 on Llama-3-8B's four linears, against
torch.mm with BF16 weights (rotated the same way).

Writes OUT/wna16-sweep-h200.json (every timing, the best config per (shape, M) and its speedup over cuBLAS, the
best per variant) and OUT/wna16_nvidia_h200.json (a candidate tuning table in the package's format: copy it to
kestrel/kernels/tuning/ once its numbers are read), and prints a summary table.

    python scripts/h200_wna16_sweep.py --out OUT            # on the H200, about 4-5 minutes (--max-seconds)
    python scripts/h200_wna16_sweep.py --out OUT --dry-run  # CPU, Triton interpreter, tiny shapes: logic check
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DRY_SHAPES = {"a": (64, 256), "b": (96, 384)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# Measured first, so a run cut short by --max-seconds still has the decode sizes.
M_ORDER = [1, 16, 4, 64, 256, 2, 8, 32, 128]
GROUP = 128
TOP = 3  # the fastest configs of a (shape, M) retried with the splits below (no new compiles)
SPLITS = {True: (4, 8, 16), False: (2, 4, 8)}  # M <= 64, M > 64
TARGETS = {1: 2.5, 2: 2.5, 4: 2.5, 8: 2.5, 16: 2.5, 64: 1.5, 256: 1.0}  # issue 28: x cuBLAS BF16


@dataclass(frozen=True)
class Candidate:
    variant: str  # the family, for the per-variant summary
    config: object  # WNA16Config (imported after the interpreter switch)


def variant_of(cfg) -> str:
    """fma-p0/1/2: the FMA path and its load pipeline; tc: one dot per K step; nib: eight nibble dots; swap:
    nibble dots with the weights as the first operand; swap1: one transposed dot per step; +fast: PTX conversion."""
    if cfg.block_m == 1:
        return f"fma-p{cfg.fma_pipeline}"
    base = {(False, False): "tc", (True, False): "nib", (False, True): "swap1", (True, True): "swap"}
    fast = cfg.fast_convert and (cfg.nibble_dots or cfg.swap_ab)
    return base[(cfg.nibble_dots, cfg.swap_ab)] + ("+fast" if fast else "")


def grid(M: int, wq) -> list:
    """Configs timed at M (split_k 0 = from the SM count, or 1 for large M; `SPLITS` retries the fastest with
    other splits): one compiled kernel per distinct tile / switch set, ~70 over all M (compile time counts)."""
    C = wq.WNA16Config
    out = []
    if M <= 4:  # FMA path: one program per activation row
        for (bn, bk, warps), pipe in itertools.product(((128, 128, 4), (256, 128, 4), (128, 256, 4), (256, 128, 8)),
                                                       (0, 1, 2)):
            out.append(C(1, bn, bk, 0, 1, warps, 4, fma_pipeline=pipe))
    if M <= 16:
        bm = 16
        tiles = [(64, 128, 4), (64, 256, 4), (128, 128, 4), (128, 256, 4)]
        swap_tiles = tiles + [(128, 128, 8), (256, 128, 8)]
        for swap, fast in itertools.product((False, True), (False, True)):
            for bn, bk, warps in swap_tiles if swap else tiles:
                out.append(C(bm, bn, bk, 0, 1, warps, 4, nibble_dots=True, swap_ab=swap, fast_convert=fast))
        for bn, warps in ((64, 4), (128, 8), (256, 8)):  # deeper pipelines: more weight bytes in flight per SM
            out.append(C(bm, bn, 128, 0, 1, warps, 6, nibble_dots=True, swap_ab=True, fast_convert=True))
        for (bn, bk, warps), fast in itertools.product(((64, 128, 4), (128, 128, 8), (64, 256, 4), (128, 256, 8)),
                                                       (False, True)):
            out.append(C(bm, bn, bk, 0, 1, warps, 4, swap_ab=True, fast_convert=fast))
        out += [C(16, 128, 128, 0, 1, 4, 4), C(16, 128, 256, 0, 1, 4, 4)]
    elif M <= 64:
        bm = 32 if M <= 32 else 64
        for swap, fast in itertools.product((False, True), (False, True)):
            for bn, warps in ((64, 4), (128, 4), (128, 8)):
                out.append(C(bm, bn, 128, 0, 1, warps, 4, nibble_dots=True, swap_ab=swap, fast_convert=fast))
        out += [C(bm, 128, 64, 0, 1, 4, 4), C(bm, 128, 128, 0, 1, 4, 4)]
        out += [C(bm, bn, 128, 0, 1, warps, 4, swap_ab=True, fast_convert=True) for bn, warps in ((64, 4), (128, 8))]
    else:
        for bm, bn in ((64, 128), (64, 256), (128, 128)):
            for fast in (False, True):
                out.append(C(bm, bn, 128, 1, 8, 8, 3, nibble_dots=True, fast_convert=fast))
            out.append(C(bm, bn, 128, 1, 8, 8, 3))
        for bm, bn in ((64, 128), (128, 128), (64, 256)):
            out.append(C(bm, bn, 128, 1, 8, 8, 3, nibble_dots=True, swap_ab=True, fast_convert=True))
        for bm, bn in ((64, 128), (128, 128)):
            out.append(C(bm, bn, 128, 1, 8, 8, 3, swap_ab=True, fast_convert=True))
    return out


def thin(configs: list) -> list:
    """Dry run: one config per variant family (every code path, few interpreter launches)."""
    seen: dict[str, object] = {}
    for cfg in configs:
        seen.setdefault(variant_of(cfg), cfg)
    return list(seen.values())


def check(out, ref) -> tuple[bool, float]:
    """One bf16 rounding of the float64 product (at most 2^-8 relative; fp32 summation order aside), as in
    tests/gpu/test_wna16_gpu.py: a wrong nibble order or zero point is off by O(1)."""
    diff = (out.double() - ref).abs()
    bound = 2.0**-7 * ref.abs() + 1e-3 * ref.abs().max()
    rel = (diff.norm() / ref.norm()).item()
    return bool((diff <= bound).all()) and rel < 5e-3, rel


def check_rounded(out, ref, abs_ref) -> tuple[bool, float]:
    """`check` for paths that round each weight to bf16 once or twice (the scale's rounding, then the product's: at
    most 2^-8 of it, relative; the prescaled tiles, the dense path) and the output once: |out - ref| <= 2^-8
    (sum |x||w| + |ref|) elementwise, `abs_ref` being sum |x||w|. A wrong code, nibble order or zero point is off by
    O(1)."""
    diff = (out.double() - ref).abs()
    ok = bool((diff <= 2.0**-8 * (abs_ref + ref.abs()) + 1e-6).all())
    return ok, (diff.norm() / ref.norm()).item()


def measure(case: dict, cands: list[Candidate], x, weights: list, ref, time_calls, check=check) -> list[dict]:
    """One row per candidate: its error against the float64 product `ref` (`check(out, ref)`: whether it is within
    the bound, and the relative error), then (if right) its time over the rotated `weights`; a config that fails to
    compile or launch, or is wrong, gets an `error` instead."""
    import torch

    from kestrel.kernels import wna16 as wq

    out = []
    for cand in cands:
        cfg = cand.config
        row = {**case, "variant": cand.variant, "config": cfg.to_json()}
        try:
            ok, rel = check(wq.wna16_gemm(x, *weights[0], torch.bfloat16, config=cfg), ref)
            row["rel_err"] = rel
            if not ok:
                raise ValueError(f"wrong result: relative error {rel:.3g}")
            row["us"] = time_calls([lambda w=w, c=cfg: wq.wna16_gemm(x, *w, torch.bfloat16, config=c)
                                    for w in weights])
            row["speedup_vs_bf16"] = case["bf16_mm_us"] / row["us"]
        except Exception as exc:  # resources this tile cannot get, or a wrong variant: logged, skipped
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out.append(row)
    return out


def rotated_weights(shapes: dict, dev: str, dry_run: bool) -> dict:
    """Per shape name: (N, K, int4 copies rotated past L2 for the kernel, the exact float64 weight [N, K], BF16
    copies of the same weights for cuBLAS)."""
    import torch
    import tune_wna16_moe as tune

    from kestrel.kernels import wna16 as wq

    data = {}
    for name, (N, K) in shapes.items():
        copies = 1 if dry_run else max(1, min(8, math.ceil(tune.L2_BYTES / (N * K // 2))))
        weights = [tune.int4_weight(N, K, seed, device=dev) for seed in range(copies)]
        dense64 = wq.dequantize_wna16(*weights[0]).double()
        bf16_copies = 1 if dry_run else max(1, min(8, math.ceil(tune.L2_BYTES / (N * K * 2))))
        dense = [wq.dequantize_wna16(*weights[i % copies]).to(torch.bfloat16) for i in range(bf16_copies)]
        data[name] = (N, K, weights, dense64, dense)
    return data


def case_inputs(M: int, K: int, dense64, dense: list, dev: str, time_calls) -> tuple:
    """(M random bf16 rows, their float64 product with the weight, cuBLAS BF16's time over the rotated copies)."""
    import torch

    x = torch.randn(M, K, generator=torch.Generator(device=dev).manual_seed(M), device=dev).to(torch.bfloat16)
    return x, x.double() @ dense64.T, time_calls([lambda d=d: torch.mm(x, d.T) for d in dense])


def call_timer(dry_run: bool):
    """`time_calls(calls) -> microseconds`: CUDA-graph replays of the rotated calls (`tune_wna16_moe.time_us`), or
    in a dry run the interpreter's wall clock of one call, only to exercise the bookkeeping."""
    import tune_wna16_moe as tune

    def time_calls(calls: list) -> float:
        if dry_run:
            t = time.perf_counter()
            calls[0]()
            return (time.perf_counter() - t) * 1e6
        return tune.time_us(calls, rep_ms=15)

    return time_calls


def new_result(shapes: dict) -> dict:
    return {"rows": [], "best": {}, "skipped": [], "seconds": 0.0, "shapes": {k: list(v) for k, v in shapes.items()}}


def run(args, save) -> dict:
    from kestrel.kernels import wna16 as wq

    dev = "cpu" if args.dry_run else "cuda"
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    ms = [1, 3, 16, 64, 128] if args.dry_run else [m for m in M_ORDER if m in args.ms]
    started = time.time()

    time_calls = call_timer(args.dry_run)
    data = rotated_weights(shapes, dev, args.dry_run)
    result = new_result(shapes)
    rows, best, skipped = result["rows"], result["best"], result["skipped"]
    for M in ms:
        configs = grid(M, wq)
        if args.dry_run:
            configs = thin(configs)
        for name, (N, K, weights, dense64, dense) in data.items():
            if time.time() - started > args.max_seconds:
                skipped.append(f"{name} M={M}")
                continue
            x, ref, mm_us = case_inputs(M, K, dense64, dense, dev, time_calls)
            table_cfg = wq.select_config(N, K, M, x.device)

            case = {"shape": name, "N": N, "K": K, "M": M, "bf16_mm_us": mm_us}
            cands = [Candidate("table", table_cfg)] + [Candidate(variant_of(c), c) for c in configs]
            timed = measure(case, cands, x, weights, ref, time_calls)
            ranked = sorted((r for r in timed[1:] if "us" in r), key=lambda r: r["us"])[:TOP]
            retry = [Candidate(r["variant"], replace(wq.WNA16Config.from_json(r["config"]), split_k=sp))
                     for r in ranked for sp in SPLITS[M <= 64]]
            timed += measure(case, retry[:1] if args.dry_run else retry, x, weights, ref, time_calls)
            rows += timed
            entry = None
            for r in timed[1:]:
                if "us" in r and (entry is None or r["us"] < entry["us"]):
                    entry = {k: r[k] for k in ("us", "bf16_mm_us", "speedup_vs_bf16", "variant", "config")}
            if entry is not None:
                best.setdefault(f"{N},{K}", {})[str(M)] = entry
                table_us = timed[0].get("us", float("nan"))
                print(f"{name:8s} M={M:3d}: best {entry['us']:7.1f} us {entry['variant']:10s} "
                      f"({entry['speedup_vs_bf16']:.2f}x bf16 {mm_us:.1f} us; current table {table_us:.1f} us) "
                      f"[{time.time() - started:.0f} s]", flush=True)
            result["seconds"] = time.time() - started
            save(result)  # after every (shape, M): a run that dies later keeps what it measured
    return result


def per_variant(rows: list[dict]) -> dict:
    """Best time of each variant family per (shape, M)."""
    out: dict[str, dict] = {}
    for r in rows:
        if "us" not in r:
            continue
        key = f"{r['shape']} M={r['M']}"
        cur = out.setdefault(key, {}).get(r["variant"])
        if cur is None or r["us"] < cur["us"]:
            out[key][r["variant"]] = {"us": r["us"], "speedup_vs_bf16": r["speedup_vs_bf16"]}
    return out


def summary(result: dict) -> str:
    shapes = result["shapes"]
    lines = ["speedup of the best config over torch.mm BF16 (rotated weights) and its variant, per shape and M"]
    ms = sorted({int(m) for e in result["best"].values() for m in e})
    lines.append(f"{'shape':8s} " + " ".join(f"{m:>16d}" for m in ms))
    for name, (N, K) in shapes.items():
        cells = []
        for m in ms:
            e = result["best"].get(f"{N},{K}", {}).get(str(m))
            cells.append(f"{e['speedup_vs_bf16']:5.2f}x {e['variant']:10s}" if e else f"{'-':>16s}")
        lines.append(f"{name:8s} " + " ".join(cells))
    lines.append("targets: " + ", ".join(f"M={m}: {t}x" for m, t in TARGETS.items()))
    variants = sorted({r["variant"] for r in result["rows"]})
    pv = result["per_variant"]
    lines.append("best speedup per variant family (min .. max over shapes) per M:")
    lines.append(f"{'variant':11s} " + " ".join(f"{m:>11d}" for m in ms))
    for v in variants:
        cells = []
        for m in ms:
            vals = [pv[k][v]["speedup_vs_bf16"] for k in pv if k.endswith(f" M={m}") and v in pv[k]]
            cells.append(f"{min(vals):4.2f}-{max(vals):4.2f}" + " " * 2 if vals else f"{'-':>11s}")
        lines.append(f"{v:11s} " + " ".join(cells))
    errors = [r for r in result["rows"] if "error" in r]
    lines.append(f"{len(result['rows'])} configs run, {len(errors)} failed or skipped (see rows[].error); "
                 f"{result['seconds']:.0f} s" + (f"; not reached: {', '.join(result['skipped'])}"
                                                  if result["skipped"] else ""))
    wrong = sorted({r["variant"] for r in errors if "wrong result" in r["error"]})
    if wrong:
        lines.append(f"WRONG RESULTS in variants: {', '.join(wrong)}")
    return "\n".join(lines)


def save(out: Path, result: dict, device: str) -> None:
    """OUT/wna16-sweep-h200.json (everything) and OUT/wna16_nvidia_h200.json (the candidate table)."""
    result["per_variant"] = per_variant(result["rows"])
    result["device"] = device
    result["note"] = ("int4 group 128, bf16 activations; times are medians of CUDA-graph replays over weight copies "
                      "rotated past L2, cuBLAS BF16 over rotated BF16 copies; every config checked against the "
                      "float64 product first")
    (out / "wna16-sweep-h200.json").write_text(json.dumps(result, indent=1) + "\n")
    table = {"gpu": "nvidia_h200",
             "note": "Measured by scripts/h200_wna16_sweep.py (W4A16 int4 group 128, bf16 activations): the fastest "
                     "config per shape and M, CUDA-graph replays over weights rotated past L2.",
             "configs": {nk: {m: e["config"] for m, e in sorted(ms.items(), key=lambda t: int(t[0]))}
                         for nk, ms in result["best"].items()}}
    (out / "wna16_nvidia_h200.json").write_text(json.dumps(table, indent=1) + "\n")


def parse_args(doc: str, ms: list[int]) -> tuple[argparse.Namespace, str]:
    """A sweep script's arguments (--out, --dry-run, --ms, --max-seconds), the interpreter switched on for a dry run
    before Triton is imported, the repository and scripts/ importable; (args, the device's name)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--ms", default=",".join(map(str, ms)), help="token counts (comma-separated)")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="stop starting new (shape, M) after this")
    args = parser.parse_args()
    args.ms = [int(m) for m in args.ms.split(",")]
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    sys.path.insert(0, str(root / "scripts"))
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry-run)")
    args.out.mkdir(parents=True, exist_ok=True)
    return args, "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)


def main() -> int:
    args, device = parse_args(__doc__, MS)
    result = run(args, lambda r: save(args.out, r, device))
    save(args.out, result, device)
    print(summary(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
