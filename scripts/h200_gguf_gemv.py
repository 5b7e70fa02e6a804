"""The weight-only decode GEMV at one row in the forms a Llama-3-8B GGUF Q4_K_M file runs (`kernels/wna16_gemv.py`):
int8 in groups of 16 (Q6_K, with float offsets where it is merged beside Q4_K parts), int4 in groups of 32 with
offsets (Q4_K), and W4A16's int4 in groups of 128, each under the slice layouts the kernel can take:

- int4: the launch feature "wna16_grouped_layout" on (a slice spanning several groups gets warps along the
  columns) and off (the GPU table's block_n / block_k as configured);
- int8: "wna16_int8_wide" off (the table's config, half its rows) and on under `int8_layout`'s warps a block and
  fewest programs (the steps a program for one row).

Every variant is checked against `wna16_gemm_ref` (relative error <= 2^-8) and timed as CUDA-graph replays over
weight copies together past L2, beside cuBLAS BF16 on the dequantized weight. Writes OUT/gguf-gemv-h200.json and
prints a table.

    PYTHONPATH=. python3 scripts/h200_gguf_gemv.py --out OUT
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/h200_gguf_gemv.py --out OUT --smoke   # CPU check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200_gemv import checked_and_timed, log, rotated_copies, timed  # noqa: E402

from kestrel.kernels import common, wna16_gemv  # noqa: E402
from kestrel.kernels import wna16 as wq  # noqa: E402

# (form, shape name, N, K): the Q4_K_M layers of the Llama-3-8B shape and W4A16's
CASES = [("int8-g16-mins", "qkv", 6144, 4096), ("int8-g16", "down", 4096, 14336),
         ("int4-g32-mins", "qkv", 6144, 4096), ("int4-g32-mins", "o", 4096, 4096),
         ("int4-g32-mins", "gate_up", 28672, 4096), ("int4-g32-mins", "down", 4096, 14336),
         ("int4-g128", "qkv", 6144, 4096), ("int4-g128", "o", 4096, 4096), ("int4-g128", "gate_up", 28672, 4096),
         ("int4-g128", "down", 4096, 14336)]
SMOKE_CASES = [("int8-g16-mins", "a", 48, 256), ("int4-g32-mins", "b", 40, 512), ("int4-g128", "c", 64, 512)]
# int8 variants under "wna16_int8_wide": (INT8_MAX_WARPS, INT8_MIN_PROGRAMS); 1 << 30 programs = one step a program
INT8_VARIANTS = [(2, 1 << 30), (2, 528), (2, 264), (2, 132), (1, 264), (4, 264)]
RUNS = 30


def make_weight(form: str, N: int, K: int, seed: int, device: torch.device) -> wq.WNA16Weight:
    g = torch.Generator(device=device).manual_seed(seed)
    kind, group_s = form.split("-")[:2]
    group = int(group_s[1:])
    scales = (torch.rand(N, K // group, generator=g, device=device) + 0.5) / (5.0 * K**0.5)
    mins = (torch.rand(N, K // group, generator=g, device=device) / (5.0 * K**0.5)) if form.endswith("mins") else None
    if kind == "int8":
        values = torch.randint(-32, 32, (N, K), generator=g, device=device, dtype=torch.int8)
        return wq.pack_wna16(values, scales, mins, weight_type="int8")
    values = torch.randint(-8, 8, (N, K), generator=g, device=device)
    if mins is None:
        return wq.pack_wna16(values, scales.to(torch.bfloat16), weight_type="int4")
    return wq.pack_wna16(values, scales, mins, weight_type="int4")


def weight_bytes(w: wq.WNA16Weight) -> int:
    return sum(t.numel() * t.element_size() for t in w[:3] if t is not None)


def with_settings(features: dict[str, bool], constants: dict, fn):
    """fn run with launch features and wna16_gemv's module constants set (kept while fn captures its launch),
    then restored."""
    def call(*args, **kwargs):
        saved = {k: getattr(wna16_gemv, k) for k in constants}
        launch_feature = common.launch_feature
        for k, v in constants.items():
            setattr(wna16_gemv, k, v)
        common.launch_feature = lambda name, device: features.get(name, launch_feature(name, device))
        try:
            return fn(*args, **kwargs)
        finally:
            common.launch_feature = launch_feature
            for k, v in saved.items():
                setattr(wna16_gemv, k, v)
    return call


def run_case(form: str, name: str, N: int, K: int, device: torch.device, runs: int) -> dict:
    first = make_weight(form, N, K, 0, device)
    nbytes = weight_bytes(first)
    copies = rotated_copies(nbytes, device)
    weights = [first] + [make_weight(form, N, K, i, device) for i in range(1, copies)]
    dense_copies = rotated_copies(N * K * 2, device)
    dense = [wq.dequantize_wna16(*weights[i % copies]).to(torch.bfloat16) for i in range(dense_copies)]
    x = torch.randn(1, K, generator=torch.Generator(device=device).manual_seed(7), device=device).to(torch.bfloat16)
    ref = wq.wna16_gemm_ref(x, *weights[0], torch.bfloat16)
    cfg = wq.select_config(N, K, 1, device)
    row = {"form": form, "shape": name, "N": N, "K": K, "bytes": nbytes, "table_config": cfg.to_json(),
           "cublas": timed(lambda i: (lambda d=dense[i]: torch.mm(x, d.T)), dense_copies, runs, device, False),
           "variants": []}
    if form.startswith("int8"):
        variants = [({"wna16_int8_wide": False}, {}, "table layout")]
        variants += [({"wna16_int8_wide": True}, {"INT8_MAX_WARPS": w, "INT8_MIN_PROGRAMS": p},
                      f"wide, warps<={w} programs>={p}") for w, p in INT8_VARIANTS]
    else:
        variants = [({"wna16_grouped_layout": on}, {}, "grouped layout" if on else "configured layout")
                    for on in (True, False)]
    for features, constants, label in variants:
        gemm = with_settings(features, constants, lambda w, c=cfg: wq.wna16_gemm(x, *w, torch.bfloat16, config=c))
        res = checked_and_timed(lambda g=gemm: g(weights[0]), ref, lambda i, g=gemm: (lambda w=weights[i]: g(w)),
                                copies, runs, device, False)
        res["label"] = label
        if res.get("us"):
            res["tb_s"] = nbytes / res["us"] * 1e-6
        row["variants"].append(res)
    cb = row["cublas"].get("us")
    cells = "  ".join(f"{v['label']}: {v.get('us', float('nan')):.1f} us {v.get('tb_s', 0):.2f} TB/s "
                      f"[{v['status']}]" for v in row["variants"])
    log(f"{form:14} {name:8} cuBLAS {cb or float('nan'):.1f} us | {cells}")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, Triton interpreter)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases, runs = (SMOKE_CASES, 1) if args.smoke else (CASES, RUNS)
    rows = [run_case(*case, device, runs) for case in cases]
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    path = args.out / "gguf-gemv-h200.json"
    path.write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    log(f"wrote {path}")
    return 0 if all(v["status"] == "ok" for r in rows for v in r["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
