"""The one-shot W4A16 decode GEMV (`kernels/wna16_gemv.py`) against what each layer runs without it: the H200 table's
`wna16` config for that M (the FMA path or the tensor-core tiles) and cuBLAS BF16 on the dequantized weight, at
Llama-3-8B's linear shapes (qkv, o, gate_up, down), int4 group 128 (GPTQ symmetric) and uint4 group 128 with zero
points (AWQ), one row (decode batch 1; `TOKENS`).

Every candidate is checked against `wna16_gemm_ref` (relative Frobenius error <= 2^-8, h200_gemv.ERR_LIMIT) and
timed as CUDA-graph replays of one call per weight copy (`kestrel.bench.timing.time_calls`), the copies together
past L2. For each (shape, M) the table gets the fastest one-shot config (summed over int4 and uint4) among those
>= 3% faster than the current entry on int4 and no slower on uint4, and keeps the current entry elsewhere; every
measured M gets its own bucket (the other buckets stay as they are).

Writes OUT/wna16-gemv-h200.json (every timing) and OUT/wna16_<gpu>.json (the merged table: copy it to
kestrel/kernels/tuning/ once read), and prints a table.

    PYTHONPATH=. python3 scripts/h200_wna16_gemv.py --out OUT            # the H200 run, about 4 minutes
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/h200_wna16_gemv.py --out OUT --smoke   # CPU check
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200_gemv import ERR_LIMIT, checked_and_timed, fastest, fmt_us, log, rotated_copies, timed  # noqa: E402

from kestrel.bench import gemm as gemm_bench  # noqa: E402
from kestrel.bench.timing import sweep_script_args  # noqa: E402
from kestrel.kernels import common  # noqa: E402
from kestrel.kernels import wna16 as wq  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"a": (48, 256), "b": (40, 512)}
TOKENS, SMOKE_TOKENS = (1,), (1, 3)
TYPES = ("int4", "uint4")
GROUP = 128
# The grid's fastest at M = 1 in a first run of 12 configs at M = 1, 2, 4, 8 (int4); above one row the one-shot kernel
# lost to the table's entry (at M = 2 but for o by 5%; at M = 4 and 8 everywhere), so the table takes it for one row.
ONESHOT = [(128, 128, 2), (256, 128, 4), (512, 128, 4), (64, 128, 2), (256, 256, 4), (512, 128, 8)]
SMOKE_ONESHOT = [(16, 64, 1), (32, 128, 2)]
WIN = 0.97
GPU_RUNS, CPU_RUNS = 30, 1
TIME_BUDGET_S = 230.0


def config(bn: int, bk: int, warps: int) -> wq.WNA16Config:
    return wq.WNA16Config(block_m=1, block_n=bn, block_k=bk, num_warps=warps, oneshot=True)


def make_weight(N: int, K: int, weight_type: str, seed: int, device: torch.device) -> wq.WNA16Weight:
    g = torch.Generator(device=device).manual_seed(seed)
    scales = ((torch.rand(N, K // GROUP, generator=g, device=device) + 0.5) / (5.0 * K**0.5)).to(torch.bfloat16)
    if weight_type == "int4":
        return wq.pack_wna16(torch.randint(-8, 8, (N, K), generator=g, device=device), scales, weight_type="int4")
    zeros = torch.randint(0, 16, (N, K // GROUP), generator=g, device=device)
    return wq.pack_wna16(torch.randint(0, 16, (N, K), generator=g, device=device), scales, zeros,
                         weight_type="uint4")


def run_case(name: str, N: int, K: int, weight_type: str, tokens: tuple[int, ...],
             candidates: list[tuple[int, int, int]], device: torch.device, bw: float, runs: int,
             started: float) -> list[dict]:
    copies = rotated_copies(N * K // 2, device)
    weights = [make_weight(N, K, weight_type, N + K + i, device) for i in range(copies)]
    dense_copies = rotated_copies(N * K * 2, device)
    dense = [wq.dequantize_wna16(*weights[i % copies]).to(torch.bfloat16) for i in range(dense_copies)]
    byts = N * K // 2 + (N * K // GROUP) * (2 + (1 if weight_type == "uint4" else 0))
    rows = []
    for M in tokens:
        t0 = time.time()
        x = torch.randn(M, K, generator=torch.Generator(device=device).manual_seed(M), device=device)
        x = x.to(torch.bfloat16)
        ref = wq.wna16_gemm_ref(x, *weights[0], torch.bfloat16)
        skip = time.time() - started > TIME_BUDGET_S
        read_us = (byts + M * (K + N) * 2) / bw * 1e6
        table_cfg = wq.select_config(N, K, M, device)
        row: dict = {"shape": name, "type": weight_type, "N": N, "K": K, "M": M, "copies": copies,
                     "read_once_us": read_us, "table_config": table_cfg.to_json()}
        row["cublas"] = timed(lambda i, x=x: (lambda d=dense[i]: torch.mm(x, d.T)), dense_copies, runs, device,
                              skip)
        row["table"] = timed(lambda i, x=x, c=table_cfg: (lambda w=weights[i]: wq.wna16_gemm(x, *w, torch.bfloat16,
                                                                                                config=c)),
                             copies, runs, device, skip)
        row["candidates"] = []
        for bn, bk, warps in candidates:
            cfg = config(bn, bk, warps)
            res = checked_and_timed(
                lambda c=cfg, x=x: wq.wna16_gemm(x, *weights[0], torch.bfloat16, config=c), ref,
                lambda i, x=x, c=cfg: (lambda w=weights[i]: wq.wna16_gemm(x, *w, torch.bfloat16, config=c)),
                copies, runs, device, skip)
            if res.get("us"):
                res["tb_s"] = byts / res["us"] * 1e-6
            row["candidates"].append(res)
        row["best"] = fastest(row["candidates"])
        row["seconds"] = time.time() - t0
        rows.append(row)
        log(table([row], candidates).splitlines()[1] + f"   [{row['seconds']:.1f} s]")
    return rows


def _us(d: dict) -> float | None:
    return d.get("us")


def table(rows: list[dict], candidates: list[tuple[int, int, int]]) -> str:
    lines = [f"{'type':5} {'shape':8} {'M':>2} {'read us':>8} {'cublas':>8} {'table':>8} {'oneshot':>8} {'cfg':>14} "
             f"{'TB/s':>5} {'x cublas':>8} {'x table':>7}"]
    for r in rows:
        best = r["candidates"][r["best"]] if r.get("best") is not None else {}
        cb, tb, us = _us(r["cublas"]), _us(r["table"]), best.get("us")
        cfg = str(candidates[r["best"]]) if r.get("best") is not None else "-"
        lines.append(f"{r['type']:5} {r['shape']:8} {r['M']:2d} {r['read_once_us']:8.1f} {fmt_us(cb)} {fmt_us(tb)} "
                     f"{fmt_us(us)} {cfg:>14} {best.get('tb_s', 0):5.2f} {(cb / us if cb and us else 0):8.2f} "
                     f"{(tb / us if tb and us else 0):7.2f}")
    return "\n".join(lines)


def merged_table(rows: list[dict], candidates: list[tuple[int, int, int]], gpu: str, current: dict) -> dict:
    """`current` (the GPU table's configs) with a bucket for every measured M of every shape: the one-shot config
    with the least summed time among those that beat the current entry by >= 3% on int4 (GPTQ's symmetric layout,
    the common download) and are no slower on uint4, else the current entry."""
    configs = copy.deepcopy(current)
    for key in dict.fromkeys((r["N"], r["K"], r["M"]) for r in rows):
        N, K, M = key
        mine = {r["type"]: r for r in rows if (r["N"], r["K"], r["M"]) == key}
        entry = next(iter(mine.values()))["table_config"]
        best = None
        for i in range(len(candidates)):
            times = {t: (r["candidates"][i].get("us"), _us(r["table"])) for t, r in mine.items()}
            if not all(us and base for us, base in times.values()):
                continue
            if all(us <= (WIN if t == "int4" else 1.0) * base for t, (us, base) in times.items()):
                total = sum(us for us, _ in times.values())
                if best is None or total < best[0]:
                    best = (total, i)
        if best is not None:
            entry = config(*candidates[best[1]]).to_json()
        configs.setdefault(f"{N},{K}", {})[str(M)] = entry
    return {"gpu": gpu, "configs": configs,
            "note": "Measured by scripts/h200_wna16_sweep.py (W4A16 int4 group 128, bf16 activations) and, for "
                    "M = 1, scripts/h200_wna16_gemv.py (the one-shot GEMV where it beat the previous entry by >= 3% "
                    "on int4 and was no slower on uint4): CUDA-graph replays over weights rotated past L2."}


def main() -> int:
    args, device = sweep_script_args(__doc__)
    started = time.time()
    gpu = common.gpu_key(common.device_name(0)) if device.type == "cuda" else "cpu"
    tokens = SMOKE_TOKENS if args.smoke else TOKENS
    candidates = SMOKE_ONESHOT if args.smoke else ONESHOT
    runs = GPU_RUNS if device.type == "cuda" else CPU_RUNS
    path = args.out / "wna16-gemv-h200.json"
    bw = gemm_bench.measure_ceilings(device)["bw"]
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    result: dict = {"env": gemm_bench.environment(None), "device": str(device), "bw": bw, "tokens": list(tokens),
                    "candidates": [config(*c).to_json() for c in candidates], "err_limit": ERR_LIMIT, "rows": []}
    for weight_type in TYPES:
        for name, (N, K) in (SMOKE_SHAPES if args.smoke else SHAPES).items():
            result["rows"] += run_case(name, N, K, weight_type, tokens, candidates, device, bw, runs, started)
            result["seconds"] = time.time() - started
            path.write_text(json.dumps(result, indent=1) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["table"] = merged_table(result["rows"], candidates, gpu, common.gpu_table("wna16", device))
    table_path = args.out / f"wna16_{gpu}.json"
    table_path.write_text(json.dumps(result["table"], indent=1) + "\n")
    result["seconds"] = time.time() - started
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["rows"], candidates))
    print("read us = int4 weights, scales (and zeros), x and out once at the copy bandwidth; x cublas / x table = "
          "their time over the one-shot GEMV's")
    print(f"wrote {path} and {table_path} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
