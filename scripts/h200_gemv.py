"""The decode GEMV (`kernels/gemv.py`) against what each linear runs without it, on one GPU: for FP8 weights the W8A8
path (the per-token activation quantizer `ops.quant_fp8_per_token` + `ops.scaled_mm`), for bf16 weights cuBLAS
(`F.linear`), at the linear shapes of Llama-3-8B (qkv, o, gate_up, down) and Qwen3-30B-A3B's attention (qkv, o) and
router (bf16 only: the router stays in the model dtype), M = 1, 2, 4, 8 rows.

For every (kind, shape, M): each candidate config is checked against `gemv_ref` (relative Frobenius error <= 2^-8)
and timed as CUDA-graph replays of one call per weight copy (`kestrel.bench.timing.time_calls`), the copies
together larger than L2 so that every call reads its weights from HBM; the baseline is timed the same way.
Everything is set against the bytes read once at the measured copy bandwidth.

The FP8 baseline is what the model runs: qkv, gate_up and down get their 8-bit input from a fused producer (the
norm's or the activation's own launch, which runs anyway), so the GEMV must beat `scaled_mm` alone; o_proj
quantizes its own input, so the GEMV must beat quantizer + `scaled_mm`. Per (kind, weight shape) the table gets
the candidate with the least summed time over the measured M, and `max_m` = the largest M up to which it beats
that baseline by >= 3% at every measured M (shapes where it never does are left out: the path stays off for them).

Writes OUT/gemv-h200.json (every timing) and OUT/gemv_<gpu>.json (the tuning table: copy it to
kestrel/kernels/tuning/ to turn the path on where it won), and prints a table.

    PYTHONPATH=. python3 scripts/h200_gemv.py --out OUT            # the H200 run, about 4 minutes
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/h200_gemv.py --out OUT --smoke   # CPU check of this script
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel import ops  # noqa: E402
from kestrel.bench import gemm as gemm_bench  # noqa: E402
from kestrel.bench.common import ARCHS  # noqa: E402
from kestrel.bench.timing import sweep_script_args, time_calls  # noqa: E402
from kestrel.kernels import common  # noqa: E402
from kestrel.kernels import gemv as gv  # noqa: E402
from kestrel.quant.w8a8_fp8 import quantize_weight_fp8  # noqa: E402

C = gv.GemvConfig
TILES = ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 1024, 8), (32, 256, 4), (32, 512, 8),
         (2, 2048, 4), (4, 2048, 8), (16, 256, 2), (64, 256, 8), (8, 2048, 8))
# And slices of 128-256 values a thread: each program's fixed work (indexing, the reduction across the slice, the
# split sums' arrival) spread over more bytes.
TILES += ((16, 1024, 4), (16, 2048, 4), (32, 1024, 4), (8, 4096, 8), (4, 4096, 4), (32, 2048, 8))
CANDIDATES = [C(block_n=n, block_k=k, num_warps=w) for n, k, w in TILES]
SMOKE_CANDIDATES = [C(block_n=8, block_k=32, num_warps=1), C(block_n=16, block_k=16, num_warps=1)]
TOKENS, SMOKE_TOKENS = (1, 2, 4, 8), (1, 2)
KINDS = ("fp8", "w16")
ERR_LIMIT = 2.0**-8
WIN = 0.97  # the GEMV must take at most 97% of the baseline's time
ROTATE_BYTES = 256 << 20  # weight copies per shape: together well past the 50 MB L2
MAX_COPIES = 32
GPU_RUNS, CPU_RUNS = 30, 1
TIME_BUDGET_S = 330.0  # past it, the remaining points are checked but not timed


def shapes_of(smoke: bool, kinds: tuple[str, ...] = KINDS, arch: str = "") -> list[dict]:
    """(kind, name, N, K, whether the model's producer quantizes an FP8 layer's input in its own launch), of the
    given kinds and of the architecture whose name `arch` starts (all where empty)."""
    return [s for s in _shapes(smoke) if s["kind"] in kinds and s["name"].startswith(arch)]


def _shapes(smoke: bool) -> list[dict]:
    if smoke:
        return [dict(kind=k, name=f"smoke/{p}", N=n, K=kk, fused=p != "o")
                for k in KINDS for p, n, kk in (("qkv", 48, 64), ("o", 40, 96))]
    out = []
    for arch, parts in (("llama3-8b", ("qkv", "o", "gate_up", "down")), ("qwen3-30b-a3b", ("qkv", "o", "router"))):
        a = ARCHS[arch]
        H, hd = a["hidden_size"], a.get("head_dim") or a["hidden_size"] // a["num_attention_heads"]
        q, kv = a["num_attention_heads"] * hd, a["num_key_value_heads"] * hd
        dims = {"qkv": (q + 2 * kv, H), "o": (H, q), "gate_up": (2 * a.get("intermediate_size", 0), H),
                "down": (H, a.get("intermediate_size", 0)), "router": (a.get("num_experts", 0), H)}
        for kind in KINDS:
            out += [dict(kind=kind, name=f"{arch}/{p}", N=dims[p][0], K=dims[p][1], fused=p != "o")
                    for p in parts if kind == "w16" or p != "router"]
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not bool(torch.isfinite(out64).all()):
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def timed(fn_of: Callable[[int], Callable[[], object]], copies: int, runs: int, device: torch.device,
          skip: bool) -> dict:
    if skip:
        return {"status": "not timed (time budget)"}
    try:
        us, graphed = time_calls([fn_of(i) for i in range(copies)], runs, device)
    except Exception as exc:  # one failing variant must not sink the whole run
        return {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"status": "ok", "us": us, "graph": graphed}


def rotated_copies(weight_bytes: int, device: torch.device) -> int:
    """How many copies of a weight the timed calls rotate through: together past L2 (ROTATE_BYTES) on a GPU, at
    least 2 and at most MAX_COPIES; 2 elsewhere."""
    if device.type != "cuda":
        return 2
    return max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / weight_bytes)))


def checked_and_timed(once: Callable[[], torch.Tensor], ref: torch.Tensor, fn_of: Callable[[int], Callable[[], object]],
                      copies: int, runs: int, device: torch.device, skip: bool) -> dict:
    """One candidate: run once and compared with `ref` (status "error" / "wrong" past ERR_LIMIT), then timed over
    the weight copies (`timed`); the result carries its error."""
    try:
        err = rel_err(once(), ref)
    except Exception as exc:  # one failing variant must not sink the whole run
        return {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if err > ERR_LIMIT:
        return {"status": "wrong", "err": err}
    return dict(timed(fn_of, copies, runs, device, skip), err=err)


def fastest(results: list[dict]) -> int | None:
    """Index of the fastest timed result, or None."""
    ok = [(r["us"], i) for i, r in enumerate(results) if r.get("us")]
    return min(ok)[1] if ok else None


def w8a8_call(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, quant: bool) -> Callable[[], object]:
    """One W8A8 call as Fp8LinearMethod runs it: with its quantizer launch, or on x quantized beforehand (what a
    fused producer hands it)."""
    if quant:
        def call() -> torch.Tensor:
            a = ops.quant_fp8_per_token(x)
            return ops.scaled_mm(a.q, q, a.scale, s, torch.bfloat16)
        return call
    a = ops.quant_fp8_per_token(x)
    return lambda: ops.scaled_mm(a.q, q, a.scale, s, torch.bfloat16)


def run_shape(shape: dict, tokens: tuple[int, ...], candidates: list[gv.GemvConfig], device: torch.device,
              bw: float, runs: int, started: float) -> list[dict]:
    kind, N, K = shape["kind"], shape["N"], shape["K"]
    wbytes = 1 if kind == "fp8" else 2
    copies = rotated_copies(N * K * wbytes, device)
    g = torch.Generator(device=device).manual_seed(N * 7 + K)
    weights = []
    for _ in range(copies):
        w = (torch.randn(N, K, generator=g, device=device) / math.sqrt(K)).to(torch.bfloat16)
        weights.append(quantize_weight_fp8(w) if kind == "fp8" else (w, None))  # (weight, scale or None)
        del w
    rows = []
    for M in tokens:
        t0 = time.time()
        x = torch.randn(M, K, generator=g, device=device).to(torch.bfloat16)
        w0, s0 = weights[0]
        ref = gv.gemv_ref(x, w0, s0, torch.bfloat16)
        byts = N * K * wbytes + (N * 4 if kind == "fp8" else 0) + M * K * 2 + M * N * 2
        read_us = byts / bw * 1e6
        skip = time.time() - started > TIME_BUDGET_S
        row: dict = {"kind": kind, "shape": shape["name"], "N": N, "K": K, "M": M, "fused_producer": shape["fused"],
                     "copies": copies, "bytes": byts, "read_once_us": read_us}
        if kind == "fp8":
            act = ops.quant_fp8_per_token(x)
            row["w8a8_err_vs_w8a16"] = rel_err(ops.scaled_mm(act.q, w0, act.scale, s0, torch.bfloat16), ref)
            row["w8a8_gemm"] = timed(lambda i, x=x: w8a8_call(x, *weights[i], False), copies, runs, device, skip)
            row["w8a8_quant_gemm"] = timed(lambda i, x=x: w8a8_call(x, *weights[i], True), copies, runs, device,
                                           skip)
        else:
            row["cublas"] = timed(lambda i, x=x: (lambda w=weights[i][0]: F.linear(x, w)), copies, runs, device,
                                  skip)
        row["candidates"] = []
        for cfg in candidates:
            res = checked_and_timed(
                lambda c=cfg, x=x, w=weights[0]: gv.gemv(x, *w, torch.bfloat16, config=c), ref,
                lambda i, x=x, c=cfg: (lambda w=weights[i]: gv.gemv(x, *w, torch.bfloat16, config=c)),
                copies, runs, device, skip)
            if res.get("us"):
                res["gb_s"] = byts / res["us"] * 1e-3
                res["x_read_once"] = res["us"] / read_us
            row["candidates"].append(res)
        row["best"] = fastest(row["candidates"])
        row["seconds"] = time.time() - t0
        rows.append(row)
        log(table([row]).splitlines()[1] + f"   [{row['seconds']:.1f} s]")
    return rows


def baseline_us(row: dict) -> float | None:
    if row["kind"] == "w16":
        return row["cublas"].get("us")
    return row["w8a8_gemm" if row["fused_producer"] else "w8a8_quant_gemm"].get("us")


def fmt_us(us: float | None, width: int = 8) -> str:
    return f"{us:{width}.1f}" if us is not None else f"{'-':>{width}}"


def table(rows: list[dict]) -> str:
    lines = [f"{'kind':4} {'shape':22} {'N':>6} {'K':>6} {'M':>2} {'read us':>8} {'base':>8} {'gemv':>8} "
             f"{'cfg':>3} {'GB/s':>6} {'x read':>6} {'vs base':>7}"]
    for r in rows:
        best = r["candidates"][r["best"]] if r.get("best") is not None else {}
        base = baseline_us(r)
        speed = f"{base / best['us']:7.2f}" if base and best.get("us") else f"{'-':>7}"
        gbs = f"{best['gb_s']:6.0f}" if best.get("gb_s") else f"{'-':>6}"
        xr = f"{best['x_read_once']:6.2f}" if best.get("x_read_once") else f"{'-':>6}"
        lines.append(f"{r['kind']:4} {r['shape']:22} {r['N']:6d} {r['K']:6d} {r['M']:2d} {r['read_once_us']:8.1f} "
                     f"{fmt_us(base)} "
                     f"{fmt_us(best.get('us'))} {r.get('best') if r.get('best') is not None else '-'!s:>3} {gbs} {xr} "
                     f"{speed}")
    return "\n".join(lines)


def tuning_table(rows: list[dict], candidates: list[gv.GemvConfig]) -> tuple[dict, dict]:
    """(table configs keyed "kind:N,K", the per-shape proposal): `max_m` = the largest measured M such that one
    candidate beats the baseline by >= 3% at every measured M up to it, and of the candidates that do, the one
    with the least summed time over those M."""
    configs: dict[str, dict] = {}
    proposal: dict[str, dict] = {}
    for kind, shape in dict.fromkeys((r["kind"], r["shape"]) for r in rows):
        name = f"{kind}:{shape}"
        mine = sorted((r for r in rows if (r["kind"], r["shape"]) == (kind, shape)), key=lambda r: r["M"])
        best: tuple[int, float, int] | None = None  # (max_m, -summed us, candidate)
        for i in range(len(candidates)):
            max_m, total = 0, 0.0
            for r in mine:
                us, base = r["candidates"][i].get("us"), baseline_us(r)
                if us is None or base is None or us > WIN * base:
                    break
                max_m, total = r["M"], total + us
            if max_m and (best is None or (max_m, -total) > best[:2]):
                best = (max_m, -total, i)
        if best is None:
            proposal[name] = {"config": None, "max_m": 0}
            continue
        max_m, _, i = best
        proposal[name] = {"config": i, "max_m": max_m}
        key = gv.table_key(kind, mine[0]["N"], mine[0]["K"])
        entry = dict(candidates[i].to_json(), max_m=max_m)
        if key in configs:  # two shapes of one weight size: the smaller win holds for both
            entry = min(configs[key], entry, key=lambda e: e["max_m"])
        configs[key] = entry
    return configs, proposal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated weight kinds to sweep, of {', '.join(KINDS)}")
    p.add_argument("--arch", default="", choices=("", "llama3-8b", "qwen3-30b-a3b"),
                   help="only this architecture's shapes (default: every one)")
    p.add_argument("--tokens", default="", help=f"comma-separated row counts (default: {','.join(map(str, TOKENS))})")


def main() -> int:
    args, device = sweep_script_args(__doc__, add_arguments)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        raise SystemExit(f"--kinds {args.kinds!r}: expected a comma-separated subset of {', '.join(KINDS)}")
    try:
        tokens = tuple(int(m) for m in args.tokens.split(",")) if args.tokens else None
    except ValueError:
        tokens = ()
    # A table entry covers every M from 1 to its max_m: the sweep must measure 1 and each M up to the largest.
    if tokens is not None and (not tokens or 1 not in tokens or not all(1 <= m <= gv.MAX_M for m in tokens)):
        raise SystemExit(f"--tokens {args.tokens!r}: expected comma-separated row counts in 1..{gv.MAX_M}, 1 among "
                         "them (a table entry covers M = 1 up to its max_m)")
    if args.smoke and args.arch:
        raise SystemExit("--arch picks a model's shapes; --smoke runs tiny shapes of no model: pass one of them")
    started = time.time()
    gpu = common.gpu_key(common.device_name(0)) if device.type == "cuda" else "cpu"
    tokens = tuple(sorted(tokens or (SMOKE_TOKENS if args.smoke else TOKENS)))
    candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    runs = GPU_RUNS if device.type == "cuda" else CPU_RUNS
    path = args.out / "gemv-h200.json"
    ceilings = gemm_bench.measure_ceilings(device)
    bw = ceilings["bw"]
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s ({'measured' if ceilings.get('measured') else 'fallback'})")
    result: dict = {"env": gemm_bench.environment(None), "device": str(device), "bw": bw, "ceilings": ceilings,
                    "tokens": list(tokens), "candidates": [c.to_json() for c in candidates], "err_limit": ERR_LIMIT,
                    "win": WIN, "rows": []}
    for shape in shapes_of(args.smoke, kinds, args.arch):
        result["rows"] += run_shape(shape, tokens, candidates, device, bw, runs, started)
        result["seconds"] = time.time() - started
        path.write_text(json.dumps(result, indent=1) + "\n")  # after every shape: a cut-off run keeps its rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    configs, proposal = tuning_table(result["rows"], candidates)
    result["proposal"] = proposal
    result["table"] = {"gpu": gpu, "configs": configs,
                       "note": "Measured by scripts/h200_gemv.py: per weight kind and shape (kind:N,K), the GEMV "
                               f"config with the least time over M = {','.join(map(str, tokens))} and the largest "
                               "M up to which it beat what "
                               "the layer runs without it (FP8: W8A8; bf16: cuBLAS) by >= 3% (CUDA-graph replays "
                               "over weights rotated past L2)."}
    table_path = args.out / f"{gv.TABLE}_{gpu}.json"
    table_path.write_text(json.dumps(result["table"], indent=1) + "\n")
    result["seconds"] = time.time() - started
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["rows"]))
    print("read us = bytes (weights, scales, x, out) once at the copy bandwidth; base = what the layer runs without "
          "the GEMV (w16: cuBLAS; fp8: scaled_mm alone where a fused producer quantizes (qkv, gate_up, down), "
          "quantizer + scaled_mm for o); gemv = best candidate (cfg); vs base = base / gemv")
    for name, prop in proposal.items():
        cfg = candidates[prop["config"]].to_json() if prop["config"] is not None else None
        print(f"proposal {name}: candidate {prop['config']} max_m {prop['max_m']} {cfg or ''}")
    print(f"wrote {path} and {table_path} (copy it to kestrel/kernels/tuning/ to turn the path on where it won) "
          f"in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
