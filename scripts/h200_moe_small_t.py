"""The small-T fused MoE path (`kernels/moe_small_t.py`) against the grouped GEMM (`kernels/fused_moe.py`) on one GPU,
at the Qwen3-30B-A3B and Mixtral-8x7B layer shapes, T = 1, 2, 4, 8, 16 tokens, BF16 and FP8 experts (per channel
and block (128, 128)).

For every (shape, variant, T): correctness first (each path against its own reference: the small-T path against
`fused_moe_small_t_ref`, the grouped GEMM against `fused_moe_ref`; FP8 also both against the BF16 weights' output,
W8A16 vs W8A8), then timing as CUDA-graph replays of one call per rotated input set (`kestrel.bench.timing`), the
sets spread over weight copies (`kestrel.bench.moe.layer_count` / `make_batch`) so that L2 does not hold the experts
between calls. The small-T path is timed at every candidate tile config; the best per point is reported, and per
(shape, variant) the single config with the least summed time over T <= 8. Then the whole MoE layer as the model
runs it (router linear, `ops.moe_route`, the experts) with either path, and at T = 1 the launches per layer (torch
profiler). Everything is set against the time to read the chosen experts (+ router) once at the measured copy
bandwidth. Writes OUT/moe-small-t-h200.json, OUT/moe_small_t_<gpu>.json (the tuning table that turns the path on
where it won: copy it to kestrel/kernels/tuning/) and prints a table.

    PYTHONPATH=. python scripts/h200_moe_small_t.py --out OUT            # the H200 run, about 3-5 minutes
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/h200_moe_small_t.py --out OUT --smoke   # CPU check of this script
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel import ops  # noqa: E402
from kestrel.bench import gemm as gemm_bench  # noqa: E402
from kestrel.bench import moe as bm  # noqa: E402
from kestrel.bench.timing import time_calls  # noqa: E402
from kestrel.kernels import common  # noqa: E402
from kestrel.kernels import fused_moe as fm  # noqa: E402
from kestrel.kernels import moe_small_t as st  # noqa: E402

TOKENS = (1, 2, 4, 8, 16)
SMOKE_TOKENS = (1, 2)
VARIANTS = ("bf16", "fp8-channel", "fp8-block")
BLOCK, SMOKE_BLOCK = (128, 128), (16, 16)
CANDIDATES = [
    st.SmallTConfig(8, block_n13=16, block_k13=256, block_n2=16, block_k2=256, num_warps=4, num_warps2=4),
    st.SmallTConfig(8, block_n13=8, block_k13=512, block_n2=8, block_k2=256, num_warps=4, num_warps2=2),
    st.SmallTConfig(8, block_n13=8, block_k13=512, block_n2=8, block_k2=256, num_warps=4, num_warps2=2,
                    split_down=True),
    st.SmallTConfig(8, block_n13=16, block_k13=512, block_n2=8, block_k2=512, num_warps=8, num_warps2=4),
    st.SmallTConfig(8, block_n13=4, block_k13=512, block_n2=4, block_k2=256, num_warps=2, num_warps2=1),
]
SMOKE_CANDIDATES = [st.SmallTConfig(8, block_n13=16, block_k13=32, block_n2=16, block_k2=16, num_warps=1, num_warps2=1),
                    st.SmallTConfig(8, block_n13=8, block_k13=64, block_n2=8, block_k2=32, num_warps=1, num_warps2=1,
                                    max_unroll=1, split_down=True)]
# Relative Frobenius error bounds: a path against its own reference (accumulation order only), and W8A16 / W8A8
# against the BF16 weights' output (the weights' and activations' e4m3 steps; informative, not a pass/fail).
ERR_LIMIT = {"bf16": 2.0**-8, "fp8": 2.0**-8, "fp8_old": 3e-2, "layer_bf16": 2.0**-8, "layer_fp8": 0.1}
GPU_RUNS, CPU_RUNS = 50, 2


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def experts_of(layer: bm.Layer, variant: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(w13, w2, fp8 keywords) of one weight copy in a variant; FP8 quantized once per copy and cached on it."""
    if variant == "bf16":
        return layer.w13, layer.w2, {}
    cache = layer.__dict__.setdefault("fp8_variants", {})
    if variant not in cache:
        b = None if variant == "fp8-channel" else block
        q13, s13 = bm.quantize_fp8(layer.w13, b)
        q2, s2 = bm.quantize_fp8(layer.w2, b)
        cache[variant] = (q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=b))
    return cache[variant]


def read_once_bytes(ids: torch.Tensor, shape: bm.Shape, variant: str, block: tuple[int, int]) -> dict[str, int]:
    fp8 = variant != "bf16"
    scales = bm.fp8_scale_bytes(shape, None if variant == "fp8-channel" else block) if fp8 else 0
    return bm.moe_bytes(ids.cpu(), shape, 1 if fp8 else 2, 2, scales)


def count_launches(fn: Callable[[], object]) -> dict | None:
    """Kernels (and memsets / copies) one eager call runs on the GPU, by name, with each one's device time (an eager
    call: a diagnosis of where the time goes, not the measurement)."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [(e.name[:80], e.time_range.elapsed_us()) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
    except Exception as exc:  # the profiler is a nicety: its failure must not sink the run
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {"count": len(kernels), "names": [n for n, _ in kernels], "us": [round(t, 2) for _, t in kernels]}


def checked(fn: Callable[[], torch.Tensor], ref: torch.Tensor, limit: float) -> dict:
    try:
        err = bm.rel_err(fn(), ref)
    except Exception as exc:  # one failing variant must not sink the whole run
        return {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"status": "ok" if err <= limit else "wrong", "err": err, "err_limit": limit}


def timed(result: dict, calls: list[Callable[[], object]], runs: int, device: torch.device) -> dict:
    if result["status"] != "ok":
        return result
    try:
        us, graphed = time_calls(calls, runs, device)
    except Exception as exc:
        return dict(result, status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
    return dict(result, us=us, graph=graphed)


def run_point(ctx: bm.Ctx, shape: bm.Shape, layers: list[bm.Layer], routers: list[torch.Tensor], variant: str,
              T: int, candidates: list[st.SmallTConfig], block: tuple[int, int], bw: float) -> dict:
    first = bm.make_batch(ctx, shape, layers, "uniform", T, 0)
    counted = read_once_bytes(first.topk_ids, shape, variant, block)
    sets = 2 if ctx.device.type != "cuda" else max(1, min(bm.MAX_SETS, math.ceil(bm.ROTATE_BYTES / counted["bytes"])))
    batches = [first] + [bm.make_batch(ctx, shape, layers, "uniform", T, i) for i in range(1, sets)]
    byts = sum(read_once_bytes(b.topk_ids, shape, variant, block)["bytes"] for b in batches) / len(batches)
    read_us = byts / bw * 1e6
    fp8 = variant != "bf16"

    def experts(b: bm.Batch, small_t, weights=None, ids=None) -> torch.Tensor:
        w13, w2, kw = experts_of(layers[b.layer], variant, block)
        return fm.fused_moe(b.x, w13, w2, b.topk_weights if weights is None else weights,
                            b.topk_ids if ids is None else ids, "silu", small_t=small_t, **kw)

    w13, w2, kw = experts_of(layers[first.layer], variant, block)
    args = (first.x, w13, w2, first.topk_weights, first.topk_ids, "silu")
    ref_new = st.fused_moe_small_t_ref(*args, **kw)
    ref_old = fm.fused_moe_ref(*args, **kw)
    row: dict = {"shape": shape.name, "dims": [shape.E, shape.k, shape.H, shape.I], "variant": variant, "T": T,
                 "sets": sets, "weight_copies": len(layers),
                 "distinct_experts": counted["distinct_experts"], "bytes": byts, "read_once_us": read_us}
    old = checked(lambda: experts(first, False), ref_old, ERR_LIMIT["fp8_old" if fp8 else "bf16"])
    row["old"] = timed(old, [lambda b=b: experts(b, False) for b in batches], ctx.runs, ctx.device)
    row["candidates"] = []
    for cfg in candidates:
        res = checked(lambda c=cfg: experts(first, c), ref_new, ERR_LIMIT["fp8" if fp8 else "bf16"])
        row["candidates"].append(timed(res, [lambda b=b, c=cfg: experts(b, c) for b in batches], ctx.runs, ctx.device))
    ok = [(r["us"], i) for i, r in enumerate(row["candidates"]) if r["status"] == "ok"]
    best = candidates[min(ok)[1]] if ok else None
    row["new"] = dict(row["candidates"][min(ok)[1]], config=min(ok)[1]) if ok else {"status": "none ok"}
    if fp8:  # W8A16 (small T) and W8A8 (grouped GEMM) against the BF16 weights' output, for the record
        exact = st.fused_moe_small_t_ref(first.x, layers[first.layer].w13, layers[first.layer].w2,
                                         first.topk_weights, first.topk_ids, "silu")
        row["err_vs_bf16_weights"] = {"old_w8a8": bm.rel_err(ref_old, exact), "new_w8a16": bm.rel_err(ref_new, exact)}
    for path in ("old", "new"):
        if row[path].get("us"):
            row[path]["x_read_once"] = row[path]["us"] / read_us
    if best is None:
        return row

    # The whole MoE layer as the model runs it: router linear, softmax top-k, the experts.
    def layer_call(b: bm.Batch, small_t) -> torch.Tensor:
        weights, ids = ops.moe_route(ops.linear(b.x, routers[b.layer]), shape.k, True)
        return experts(b, small_t, weights, ids)

    router_bytes = shape.E * shape.H * 2
    layer_bytes = []
    for b in batches:
        _, ids = ops.moe_route(ops.linear(b.x, routers[b.layer]), shape.k, True)
        layer_bytes.append(read_once_bytes(ids, shape, variant, block)["bytes"] + router_bytes)
    layer_read_us = sum(layer_bytes) / len(layer_bytes) / bw * 1e6
    layer_ref = layer_call(first, False)
    lim = ERR_LIMIT["layer_fp8" if fp8 else "layer_bf16"]
    lay = {"read_once_us": layer_read_us}
    for path, choice in (("old", False), ("new", best)):
        res = checked(lambda c=choice: layer_call(first, c), layer_ref, lim)
        lay[path] = timed(res, [lambda b=b, c=choice: layer_call(b, c) for b in batches], ctx.runs, ctx.device)
        if lay[path].get("us"):
            lay[path]["x_read_once"] = lay[path]["us"] / layer_read_us
        if T == 1:
            lay[path]["launches"] = count_launches(lambda c=choice: layer_call(first, c))
    row["layer"] = lay
    return row


def _us(r: dict | None) -> str:
    if not r or r.get("us") is None:
        return f"{(r or {}).get('status', '-'):>16}"
    return f"{r['us']:8.1f} ({r['x_read_once']:4.2f}x)"


def table(rows: list[dict]) -> str:
    head = (f"{'shape':14} {'variant':11} {'T':>3} {'read us':>8} {'old us (x read)':>16} {'new us (x read)':>16} "
            f"{'speedup':>7} cfg {'layer old':>16} {'layer new':>16} launches")
    lines = [head]
    for r in rows:
        old, new, lay = r.get("old"), r.get("new"), r.get("layer", {})
        speed = f"{old['us'] / new['us']:7.2f}" if old.get("us") and new.get("us") else f"{'-':>7}"
        launches = "/".join(str((lay.get(p, {}).get("launches") or {}).get("count", "-")) for p in ("old", "new"))
        lines.append(f"{r['shape']:14} {r['variant']:11} {r['T']:3d} {r['read_once_us']:8.1f} {_us(old)} {_us(new)} "
                     f"{speed} {new.get('config', '-')!s:>3} {_us(lay.get('old'))} {_us(lay.get('new'))} "
                     f"{launches if r['T'] == 1 else ''}")
    return "\n".join(lines)


def proposal(rows: list[dict], candidates: list[st.SmallTConfig]) -> dict:
    """Per (shape, variant): the candidate with the least summed time over T <= 8, and the largest T up to which
    that candidate beats the grouped GEMM at every T."""
    out = {}
    for key in sorted({(r["shape"], r["variant"]) for r in rows}):
        mine = sorted((r for r in rows if (r["shape"], r["variant"]) == key), key=lambda r: r["T"])
        totals = []
        for i in range(len(candidates)):
            us = [r["candidates"][i].get("us") for r in mine if r["T"] <= 8]
            if us and all(u is not None for u in us):
                totals.append((sum(us), i))
        if not totals:
            out["/".join(key)] = {"config": None}
            continue
        i = min(totals)[1]
        wins = 0
        for r in mine:
            us, old = r["candidates"][i].get("us"), r["old"].get("us")
            if us is None or old is None or us >= old:
                break
            wins = r["T"]
        out["/".join(key)] = {"config": i, "tiles": candidates[i].to_json(), "faster_up_to_T": wins}
    return out


def small_t_table(rows: list[dict], prop: dict, candidates: list[st.SmallTConfig]) -> dict:
    """`tuning/moe_small_t_<gpu>.json`'s configs: per (shape, weight kind) where the small-T path won, its tiles with
    max_tokens = the largest T up to which it was faster at every measured T."""
    dims = {r["shape"]: r["dims"] for r in rows}
    configs = {}
    for key, p in prop.items():
        shape, variant = key.split("/")
        if p.get("config") is None or not p.get("faster_up_to_T"):
            continue
        E, _, H, inter = dims[shape]
        kind = st.weight_kind(variant != "bf16", None if variant in ("bf16", "fp8-channel") else BLOCK)
        tiles = candidates[p["config"]].to_json()
        configs[st.table_key(E, inter, H, kind)] = dict(tiles, max_tokens=p["faster_up_to_T"])
    return configs


def gpu_key(device: torch.device) -> str:
    return common.gpu_key(common.device_name(0)) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (run under TRITON_INTERPRET=1)")
    p.add_argument("--shapes", default=None, help="comma-separated presets of kestrel bench moe (default: both)")
    p.add_argument("--tokens", default=None, help="comma-separated T (default 1,2,4,8,16)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--candidates", default=None, help="comma-separated indices into CANDIDATES (default: all; "
                                                          "fewer compile faster)")
    args = p.parse_args(argv)
    started = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = bm.parse_shapes([args.shapes] if args.shapes else None, args.smoke)
    tokens = bm.parse_ints(args.tokens, "--tokens") if args.tokens else (SMOKE_TOKENS if args.smoke else TOKENS)
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants):
        p.error(f"--variants: expected some of {VARIANTS}")
    candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    if args.candidates:
        candidates = [candidates[int(i)] for i in args.candidates.split(",") if i.strip()]
    block = SMOKE_BLOCK if args.smoke else BLOCK
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "moe-small-t-h200.json"
    ceilings = gemm_bench.measure_ceilings(device)
    bw = ceilings["bw"]
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s ({'measured' if ceilings.get('measured') else 'fallback'})")
    result = {"env": bm.environment(device, None), "bw": bw, "ceilings": ceilings, "tokens": list(tokens),
              "variants": variants, "fp8_block": list(block), "candidates": [asdict(c) for c in candidates],
              "default": asdict(st.DEFAULT), "err_limit": ERR_LIMIT, "rows": []}
    runs = GPU_RUNS if device.type == "cuda" else CPU_RUNS
    for shape in shapes:
        ctx = bm.Ctx(device, "bf16", None, runs, ("uniform",), tokens, (), 1.0, 0, ceilings)
        layers = bm.make_layers(ctx, shape, bm.layer_count(ctx, shape))
        gen = torch.Generator(device=device).manual_seed(bm.seed_of(shape.name, "router"))
        routers = [(torch.randn(shape.E, shape.H, generator=gen, device=device) / math.sqrt(shape.H)).to(torch.bfloat16)
                   for _ in layers]
        log(f"{shape.name}: {len(layers)} weight copies")
        for variant in variants:
            for T in tokens:
                t0 = time.time()
                row = run_point(ctx, shape, layers, routers, variant, T, candidates, block, bw)
                row["seconds"] = time.time() - t0
                result["rows"].append(row)
                log(table([row]).splitlines()[1] + f"   [{row['seconds']:.1f} s]")
                result["seconds"] = time.time() - started
                path.write_text(json.dumps(result, indent=1) + "\n")  # after every point: a cut-off run keeps its rows
        del layers, routers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["proposal"] = proposal(result["rows"], candidates)
    table_path = args.out / f"{st.TABLE}_{gpu_key(device)}.json"
    result["table"] = {"gpu": gpu_key(device), "configs": small_t_table(result["rows"], result["proposal"], candidates),
                       "note": "Measured by scripts/h200_moe_small_t.py: per layer shape (E,2I,H) and weight kind, the "
                               "small-T tiles with the least time over T <= 8 and the largest T up to which they beat "
                               "the grouped GEMM (CUDA-graph replays over weights rotated past L2)."}
    table_path.write_text(json.dumps(result["table"], indent=1) + "\n")
    result["seconds"] = time.time() - started
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["rows"]))
    print("x = time / reading the chosen experts (layer: + router) once at the copy bandwidth; cfg = best candidate;"
          " launches = kernels per layer at T = 1 (old/new)")
    for key, prop in result["proposal"].items():
        print(f"proposal {key}: candidate {prop['config']} faster than the grouped GEMM up to "
              f"T = {prop.get('faster_up_to_T', '-')}  {prop.get('tiles', '')}")
    print(f"wrote {path} and {table_path} (copy it to kestrel/kernels/tuning/ to turn the path on where it won) "
          f"in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
