"""The FP8 dots' prefill attention with half of each tile's exp2 on the FMA units (`attention.FP8_DOTS_EXP2_SPLIT`)
against all of it on the special-function unit, on one GPU: one causal sequence of the Llama-3-8B attention shape
(scripts/h200_prefill_attention.py's cases) at 4k-16k and a 2k chunk over 8k, the FP8 dots' tile of the table and
two others. Each output is checked against the gathered launch's (fp16 dots) and the split's against the plain
one's; then both are timed in CUDA-graph replays. Writes OUT/attention-exp2-<gpu>.json.

    PYTHONPATH=$PWD python3 scripts/h200_attention_exp2.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import h200_prefill_attention as cases  # noqa: E402

from kestrel.bench.timing import time_calls  # noqa: E402
from kestrel.kernels import attention, common  # noqa: E402
from kestrel.kernels.attention import AttnConfig, staged_kv_ref  # noqa: E402

SHAPES = [(4096, 4096), (8192, 8192), (16384, 16384), (2048, 8192)]
CONFIGS = [None, AttnConfig(128, 128, 8, 3), AttnConfig(64, 64, 4, 3)]  # None: the table's


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    common.launch_feature = cases._feature_on
    cases.FP8_DOTS["on"] = True
    attention.FP8_DOTS_MIN_TOKENS = 0
    gen = torch.Generator(device=device).manual_seed(0)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "rows": []}
    out_file = Path(args.out) / f"attention-exp2-{common.gpu_key(common.device_name(0))}.json"
    for query_len, ctx in SHAPES:
        case = cases.make_case(query_len, ctx, torch.float8_e4m3fn, device, gen)
        staged = staged_kv_ref(case["k"], case["v"], case["slots"])
        gathered_out, gathered = cases.call(case, None, None, True)
        gathered()
        for cfg in CONFIGS:
            row = {"query_len": query_len, "ctx": ctx, "TFLOP": cases.flops(query_len, ctx) / 1e12,
                   "config": None if cfg is None else [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages]}
            outs = {}
            for split in (False, True):
                attention.FP8_DOTS_EXP2_SPLIT = split
                out, fn = cases.call(case, staged, cfg, True)
                fn()
                torch.cuda.synchronize()
                outs[split] = out.float().clone()
                err = ((out.float() - gathered_out.float()).norm() / gathered_out.float().norm()).item()
                us = time_calls([fn], args.runs, device)[0]
                row["split" if split else "plain"] = {"us": us, "err_vs_fp16_dots": err,
                                                      "TFLOP/s": row["TFLOP"] * 1e6 / us}
            row["split_vs_plain"] = ((outs[True] - outs[False]).norm() / outs[False].norm()).item()
            row["speedup"] = row["plain"]["us"] / row["split"]["us"]
            print(f"q={query_len} ctx={ctx} cfg={row['config']}: plain {row['plain']['us']:.1f} us "
                  f"({row['plain']['TFLOP/s']:.0f} TFLOP/s, err {row['plain']['err_vs_fp16_dots']:.4f}) | split "
                  f"{row['split']['us']:.1f} us ({row['split']['TFLOP/s']:.0f}, err "
                  f"{row['split']['err_vs_fp16_dots']:.4f}) x{row['speedup']:.3f}, split vs plain "
                  f"{row['split_vs_plain']:.2e}", flush=True)
            result["rows"].append(row)
            out_file.write_text(json.dumps(result, indent=1))
        attention.FP8_DOTS_EXP2_SPLIT = False
        del case, staged
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
