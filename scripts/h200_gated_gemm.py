"""The FP8 gate/up GEMM whose epilogue writes act(gate) * up (`scaled_mm.scaled_mm_gated`), against the launches it
replaces, on one GPU: Llama-3-8B's gate_up (2 x 14,336 x 4,096) and Qwen3-8B's (2 x 12,288 x 4,096) at M = 128 to
8,192 rows.

- separate: `scaled_mm` writing `[M, 2I]` bf16, then `act_mul_quant` (SiLU-and-multiply quantized per token for the
  down projection): what an FP8 MLP runs without the feature;
- gated: `scaled_mm_gated` writing `[M, I]` bf16, then `quant_fp8_per_token` of it.

Each pair is checked first (the gated product equal to `act_mul` of the separate GEMM's output bit for bit; the
norm-wise difference of the two quantized products reported: the gated one quantizes the product's bf16 rounding,
the separate one its fp32 value), then timed as CUDA-graph replays over inputs rotated
past L2 (`kestrel.bench.timing.time_calls`). Writes OUT/gated-gemm-<gpu>.json and prints a table.

    PYTHONPATH=. python3 scripts/h200_gated_gemm.py --out OUT
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/h200_gated_gemm.py --out OUT --smoke   # CPU check of this script
"""

from __future__ import annotations

import json

import torch

from kestrel.bench.timing import sweep_script_args, time_calls
from kestrel.kernels import activation as act_kernels
from kestrel.kernels import quant_act
from kestrel.kernels import scaled_mm as smm
from kestrel.kernels.common import device_name, gpu_key

SHAPES = {"llama3-8b": (14336, 4096), "qwen3-8b": (12288, 4096)}
ROWS = (128, 512, 2048, 8192)
SMOKE_SHAPES = {"smoke": (48, 64)}
SMOKE_ROWS = (70,)
ROTATE_BYTES = 200 * 2**20
RUNS = 30


def make(inter: int, hidden: int, rows: int, device: torch.device, copies: int, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(2 * inter, hidden, generator=g, device=device) * 0.02)
    w_scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
    w8 = (w / w_scale).to(torch.float8_e4m3fn)
    xs = []
    for _ in range(copies):
        x = torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)
        xs.append(quant_act.quant_fp8_per_token(x) if device.type == "cuda" else quant_act.quant_fp8_per_token_ref(x))
    return w8, w_scale, xs


def measure(name: str, inter: int, hidden: int, rows: int, device: torch.device, smoke: bool) -> dict:
    per_call = rows * 2 * inter * 2 + rows * hidden
    copies = 2 if smoke else max(2, min(16, ROTATE_BYTES // per_call + 1))
    w8, ws, xs = make(inter, hidden, rows, device, copies, seed=rows)
    act = xs[0]
    separate_mm = smm.scaled_mm(act.q, w8, act.scale, ws, torch.bfloat16)
    gated = smm.scaled_mm_gated(act.q, w8, act.scale, ws, torch.bfloat16, "silu")
    equal = bool(torch.equal(gated, act_kernels.act_mul(separate_mm, "silu")))
    q_sep = quant_act.act_mul_quant(separate_mm, "silu", torch.float8_e4m3fn)
    q_gated = quant_act.quant_fp8_per_token(gated)
    dq_sep = q_sep.q.float() * q_sep.scale
    rel = float((q_gated.q.float() * q_gated.scale - dq_sep).norm() / dq_sep.norm())

    def separate(a):
        y = smm.scaled_mm(a.q, w8, a.scale, ws, torch.bfloat16)
        return quant_act.act_mul_quant(y, "silu", torch.float8_e4m3fn)

    def fused(a):
        return quant_act.quant_fp8_per_token(smm.scaled_mm_gated(a.q, w8, a.scale, ws, torch.bfloat16, "silu"))

    runs = 3 if smoke else RUNS
    t_sep, graphed = time_calls([lambda a=a: separate(a) for a in xs], runs, device)
    t_fused, _ = time_calls([lambda a=a: fused(a) for a in xs], runs, device)
    gemm_only, _ = time_calls([lambda a=a: smm.scaled_mm(a.q, w8, a.scale, ws, torch.bfloat16) for a in xs],
                              runs, device)
    gated_only, _ = time_calls([lambda a=a: smm.scaled_mm_gated(a.q, w8, a.scale, ws, torch.bfloat16, "silu")
                                for a in xs], runs, device)
    print(f"{name:10s} M={rows:5d} separate {t_sep:9.1f} us (GEMM {gemm_only:9.1f}) | gated {t_fused:9.1f} us "
          f"(GEMM {gated_only:9.1f}) x{t_sep / t_fused:.3f}  equal={equal} qdiff={rel:.2e}", flush=True)
    return {"shape": name, "inter": inter, "hidden": hidden, "rows": rows, "copies": len(xs),
            "equal_to_act_mul": equal, "quantized_rel_diff": rel, "graphed": graphed,
            "separate_us": t_sep, "gated_us": t_fused, "gemm_us": gemm_only, "gated_gemm_us": gated_only,
            "speedup": t_sep / t_fused}


def main() -> int:
    args, device = sweep_script_args(__doc__)
    shapes, rows_list = (SMOKE_SHAPES, SMOKE_ROWS) if args.smoke else (SHAPES, ROWS)
    on_gpu = device.type == "cuda"
    result = {"gpu": torch.cuda.get_device_name(0) if on_gpu else "cpu", "points": []}
    out_file = args.out / f"gated-gemm-{gpu_key(device_name(0)) if on_gpu else 'cpu'}.json"
    for name, (inter, hidden) in shapes.items():
        for rows in rows_list:
            result["points"].append(measure(name, inter, hidden, rows, device, args.smoke))
            out_file.write_text(json.dumps(result, indent=1))
    return 0 if all(p["equal_to_act_mul"] for p in result["points"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
