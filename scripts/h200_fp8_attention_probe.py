"""Probe: causal prefill attention over staged K/V with the dots in FP8 (e4m3 q, K, P and V) against fp16 / bf16
dots, one kernel shaped as the paged launch (GQA group packed into the rows). Checks each variant against a float64
reference and times it at 1k-16k tokens; JSON under --out. `--smoke` runs a small case (Triton's interpreter too)."""
import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.kernels.common import round_e4m3  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _probe(q_ptr, k_desc, v_desc, o_ptr, qk_scale, T, GROUP: tl.constexpr, HEAD: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, VT: tl.constexpr,
           P_SCALE: tl.constexpr, EMULATE: tl.constexpr):
    # MODE 0: 16-bit dots (the descriptors' dtype); 1: FP8 dots
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tok0 = pid * BLOCK_Q
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD)
    tok_in = q_tok0 + offs_m // GROUP
    row_ok = tok_in < T
    head = kv_head * GROUP + offs_m % GROUP
    q_ptrs = q_ptr + tok_in[:, None] * (tl.num_programs(1) * GROUP * HEAD) + head[:, None] * HEAD + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if MODE == 1:
        qf = q.to(tl.float32)
        q_amax = tl.max(tl.abs(qf), 1)
        q_row_scale = tl.where(q_amax > 0, q_amax / 448.0, 1.0)
        qs = tl.clamp(qf / q_row_scale[:, None], -448.0, 448.0)
        if EMULATE:
            qd = round_e4m3(qs)
        else:
            qd = qs.to(tl.float8e4nv)
        row_scale = q_row_scale * qk_scale
    else:
        qd = q.to(tl.float32) if EMULATE else q.to(k_desc.dtype)
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    hi = tl.minimum(q_tok0 + BLOCK_Q, T)
    full = (q_tok0 + 1) // BLOCK_N
    n_tiles = tl.cdiv(hi, BLOCK_N)
    col = kv_head * HEAD
    for masked in tl.static_range(2):
        lo_t = full if masked else 0
        hi_t = n_tiles if masked else full
        for t in range(lo_t, hi_t):
            key0 = t * BLOCK_N
            k = k_desc.load([key0, col])
            if EMULATE:
                k = k.to(tl.float32)
            qk = tl.dot(qd, tl.trans(k)) * row_scale[:, None]
            if masked:
                tok = key0 + offs_n
                qk = tl.where(tok[None, :] <= tok_in[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if MODE == 1:
                if EMULATE:
                    pd = round_e4m3(p * P_SCALE)
                else:
                    pd = (p * P_SCALE).to(tl.float8e4nv)
            else:
                pd = p if EMULATE else p.to(k_desc.dtype)
            if VT:
                v = tl.trans(v_desc.load([col, key0]))
            else:
                v = v_desc.load([key0, col])
            if EMULATE:
                v = v.to(tl.float32)
            if masked:
                v = tl.where((key0 + offs_n)[:, None] < T, v, 0.0)
            acc = tl.dot(pd, v, acc)
            m_i = m_new
    scale = P_SCALE if MODE == 1 else 1.0
    o = acc / (l_i[:, None] * scale)
    o_ptrs = o_ptr + tok_in[:, None] * (tl.num_programs(1) * GROUP * HEAD) + head[:, None] * HEAD + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def run(q, k, v, mode, vt, cfg, p_scale=256.0, emulate=False):
    T, H, D = q.shape
    kvh = k.shape[1] // D
    bm, bn, w, st = cfg
    o = torch.empty_like(q)
    kd = TensorDescriptor(k, list(k.shape), [k.stride(0), 1], [bn, D])
    if vt:
        vd = TensorDescriptor(v, list(v.shape), [v.stride(0), 1], [D, bn])
    else:
        vd = TensorDescriptor(v, list(v.shape), [v.stride(0), 1], [bn, D])
    grid = (triton.cdiv(T, bm // (H // kvh)), kvh)
    _probe[grid](q, kd, vd, o, D ** -0.5 * LOG2E, T, GROUP=H // kvh, HEAD=D, BLOCK_M=bm, BLOCK_N=bn, MODE=mode,
                 VT=vt, P_SCALE=p_scale, EMULATE=emulate, num_warps=w, num_stages=st)
    return o


def reference(q, kf, vf, group):
    """float64 causal GQA attention, a few heads at a time."""
    T, H, D = q.shape
    out = torch.empty(T, H, D, dtype=torch.float64, device=q.device)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    for h0 in range(0, H, group):
        kv = h0 // group
        qq = q[:, h0:h0 + group].double().transpose(0, 1)
        kk = kf.view(T, -1, D)[:, kv].double()
        vv = vf.view(T, -1, D)[:, kv].double()
        s = (qq @ kk.t() * D ** -0.5).masked_fill(mask, float("-inf"))
        out[:, h0:h0 + group] = (s.softmax(-1) @ vv).transpose(0, 1)
    return out


def inputs(T, H, KVH, D, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D, device=device, generator=g).to(torch.bfloat16) * 2
    k = (torch.randn(T, KVH * D, device=device, generator=g) * 3).to(torch.float8_e4m3fn)
    v = (torch.randn(T, KVH * D, device=device, generator=g)).to(torch.float8_e4m3fn)
    return q, k, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    emulate = device == "cpu"
    H, KVH, D = (32, 8, 128)
    results = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "rows": []}
    lengths = [64, 200] if args.smoke else [1024, 2048, 4096, 8192, 16384]
    cfgs = [(128, 64, 4, 2)] if args.smoke else [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
                                                 (128, 64, 8, 3)]
    for T in lengths:
        q, k8, v8 = inputs(T, H, KVH, D, device)
        tpad = (T + 15) // 16 * 16
        vt8 = torch.zeros(KVH * D, tpad, dtype=torch.float8_e4m3fn, device=device)
        vt8[:, :T] = v8.t()
        k16, v16 = k8.to(torch.float16), v8.to(torch.float16)
        kb, vb = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
        ref = reference(q, k8.float(), v8.float(), H // KVH) if T <= 8192 else None
        flops = 4 * H * D * T * (T + 1) / 2
        variants = {"bf16": (kb, vb, 0, False), "fp16": (k16, v16, 0, False)}
        if emulate:
            variants["fp8_emulated"] = (k16.float(), v16.float(), 1, False)
        else:
            variants.update(fp8_v=(k8, v8, 1, False), fp8_vt=(k8, vt8, 1, True))
        for name, (kk, vv, mode, vt) in variants.items():
            for cfg in cfgs:
                row = {"T": T, "variant": name, "cfg": list(cfg)}
                launch = functools.partial(run, q, kk, vv, mode, vt, cfg, emulate=emulate)
                try:
                    o = launch()
                    if ref is not None:
                        err = (o.double() - ref)
                        row["max_abs_err"] = err.abs().max().item()
                        row["rms_err"] = err.pow(2).mean().sqrt().item()
                        row["ref_rms"] = ref.pow(2).mean().sqrt().item()
                    if device == "cuda":
                        ms = triton.testing.do_bench(launch, warmup=25, rep=100)
                        row["us"] = ms * 1e3
                        row["tflops"] = flops / ms / 1e9
                except Exception as e:  # a config that does not compile is a result too
                    row["error"] = str(e)[:300]
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8-attention-probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
