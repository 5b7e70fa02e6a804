"""A/B of the FP8-KV decode attention kernel in one GPU job: a baseline copy of kestrel/kernels/attention.py
(`--before FILE`) against the current one, and the current one over a few tile configs.

    python scripts/attention_fp8_ab.py --before .ab/attention_before.py --out DIR

Decode batches of Llama-3-8B attention (32 query / 8 KV heads of 128, 16-token pages scattered over the pool),
e4m3 cache with per-tensor scales. Every variant is checked against the baseline output (and the float64
reference on the small shapes) before it is timed (CUDA-graph replay, median). Writes DIR/attention-fp8-ab.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.bench.timing import time_calls  # noqa: E402
from kestrel.kernels import attention as current  # noqa: E402

SHAPES = [(1, 2048), (16, 8192), (64, 4096), (256, 1536), (512, 1572), (256, 8192)]
CONFIGS = [(16, 64, 4, 2), (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 2), (16, 128, 4, 3), (16, 128, 4, 5),
           (16, 128, 8, 3), (16, 256, 8, 3), (16, 32, 4, 4), (16, 64, 2, 3)]
HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
K_SCALE, V_SCALE = 0.02, 0.015


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("attention_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["attention_before"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", type=int, default=50)
    args = p.parse_args()
    before = load_before(args.before)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    need = max(b * -(-c // BLOCK) for b, c in SHAPES)
    shape = (need, BLOCK, KV_HEADS, HEAD)
    k8 = torch.empty(shape, dtype=torch.float8_e4m3fn, device=dev)
    v8 = torch.empty_like(k8)
    for t, s in ((k8, K_SCALE), (v8, V_SCALE)):
        for lo in range(0, need, 8192):
            t[lo:lo + 8192] = (torch.randn(t[lo:lo + 8192].shape, device=dev) / s * 0.05).clamp(-448, 448).to(t.dtype)
    perm = torch.randperm(need, device=dev).to(torch.int32)
    rows = []
    for batch, ctx in SHAPES:
        width = -(-ctx // BLOCK)
        tables = perm[: batch * width].reshape(batch, width).contiguous()
        q = torch.randn(batch, HEADS, HEAD, device=dev, dtype=torch.bfloat16)
        qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        scale = HEAD ** -0.5

        def run(module, cfg=None, out=None, q=q, qsl=qsl, lens=lens, tables=tables, scale=scale):
            return module.paged_attention(q, k8, v8, qsl, lens, tables, scale, k_scale=K_SCALE, v_scale=V_SCALE,
                                          out=out, max_query_len=1, decode_cfg=cfg)

        base = run(before)
        ref_err = None
        if batch * ctx <= 16 * 8192 and batch <= 16:
            try:
                ref = current.paged_attention_ref(q.double(), k8.double(), v8.double(), qsl, lens, tables, scale,
                                                  k_scale=K_SCALE, v_scale=V_SCALE).double()
                ref_err = float((base.double() - ref).norm() / ref.norm())
            except Exception as e:  # the reference is a check, not the measurement
                ref_err = repr(e)[:200]
        kv_bytes = batch * ctx * KV_HEADS * HEAD * 2 + 2 * batch * HEADS * HEAD * 2
        row = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes, "before_vs_ref": ref_err, "variants": {}}
        variants = [("before", before, None), ("after", current, None)]
        variants += [(f"after{c}", current, current.AttnConfig(*c)) for c in CONFIGS]
        for name, module, cfg in variants:
            out = torch.full_like(q, float("nan"))
            run(module, cfg, out)
            err = float((out.double() - base.double()).norm() / base.double().norm())
            if not err < 2e-3:
                row["variants"][name] = {"error": err}
                continue
            us, graphed = time_calls([lambda m=module, c=cfg, o=out: run(m, c, o)], args.runs, dev)
            row["variants"][name] = {"us": round(us, 2), "TBps": round(kv_bytes / us / 1e6, 3), "err_vs_before": err,
                                     "graph": graphed}
        rows.append(row)
        best = min((v["us"], k) for k, v in row["variants"].items() if "us" in v)
        b, a = row["variants"]["before"], row["variants"].get("after", {})
        print(f"{batch:>4} x {ctx:>5}: before {b['us']:9.1f} us {b['TBps']:.2f} TB/s | after {a.get('us', 0):9.1f} us "
              f"{a.get('TBps', 0):.2f} TB/s | best {best[1]} {best[0]:.1f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention-fp8-ab.json").write_text(json.dumps({"shapes": rows}, indent=1))


if __name__ == "__main__":
    main()
