"""A weight-only layer's weight made dense `[K, N]` in one pass, for prompts: `wna16.wna16_gemm` then hands the
product to cuBLAS.

The tensor-core tiles of `wna16` scale each K step's partial product by its group before summing; in groups of 16
or 32 (GGUF's K-quants, Q8_0) every 16-32 rows of K cost a pass of FMAs over the whole accumulator tile, as many
as the MMA's, and a prompt's step ran several times slower than the BF16 GEMM. Written out once (the packed bytes
read, two bytes a weight written) the weight goes through cuBLAS at its own speed; at a prompt's row counts the
extra pass costs less than those per-step scalings.

Types: int4 (codes minus 8), uint4 with integer zero points, int8, each with float offsets (w = s * v - m) or not,
and fp8_e4m3 (a block-FP8 checkpoint's weight run weight-only); the value is s * (v - z) (or s * v - m) in fp32,
rounded once to the activations' dtype. Act-order weights are
written in their sorted-K order (their groups contiguous), which the caller's x gathered by `perm` meets. The other
types keep the tiles (`takes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import common

TYPES = ("int4", "uint4", "int8", "fp8_e4m3")
_FOUR_BIT = ("int4", "uint4")
BLOCK_K, BLOCK_N = 64, 128


def takes(weight_type: str) -> bool:
    return weight_type in TYPES


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, group, stride_wk, stride_sg, stride_zg, stride_ok,
                    FOUR_BIT: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, FAST: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows [pid_k * BLOCK_K, +BLOCK_K) and columns [pid_n * BLOCK_N, +BLOCK_N) of the dense weight."""
    pid_k = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    if FOUR_BIT:
        wrows = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + wrows.to(tl.int64)[:, None] * stride_wk + cols[None, :], mask=n_ok[None, :])
        for s in tl.static_range(8):
            k = wrows * 8 + s
            _store_rows(((words >> (4 * s)) & 15).to(tl.float32), k, cols, n_ok, s_ptr, z_ptr, out_ptr, group,
                        stride_sg, stride_zg, stride_ok, FOUR_BIT, HAS_ZEROS, HAS_MINS, FAST)
    else:
        k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        values = tl.load(w_ptr + k.to(tl.int64)[:, None] * stride_wk + cols[None, :], mask=n_ok[None, :])
        _store_rows(values.to(tl.float32), k, cols, n_ok, s_ptr, z_ptr, out_ptr, group, stride_sg, stride_zg,
                    stride_ok, FOUR_BIT, HAS_ZEROS, HAS_MINS, FAST)


@triton.jit
def _store_rows(v, k, cols, n_ok, s_ptr, z_ptr, out_ptr, group, stride_sg, stride_zg, stride_ok,
                FOUR_BIT: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, FAST: tl.constexpr):
    g = (k // group)[:, None]
    mask = n_ok[None, :]
    scale = tl.load(s_ptr + g * stride_sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if FOUR_BIT and not HAS_ZEROS:
        v = v - 8.0
    if HAS_ZEROS:
        v = v - tl.load(z_ptr + g * stride_zg + cols[None, :], mask=mask, other=0).to(tl.float32)
    w = v * scale
    if HAS_MINS:
        w -= tl.load(z_ptr + g * stride_zg + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + k.to(tl.int64)[:, None] * stride_ok + cols[None, :],
             common.to_dtype(w, out_ptr.dtype.element_ty, FAST), mask=mask)


def dequantize_kn(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, weight_type: str,
                  group: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[K, N]` in `dtype` (sorted-K order), from `wna16`'s layout (arguments as `wna16_gemm` has checked
    them; `takes` says which)."""
    four_bit = weight_type in _FOUR_BIT
    K = qweight.shape[0] * (8 if four_bit else 1)
    N = qweight.shape[1]
    out = torch.empty((K, N), dtype=dtype, device=qweight.device)
    mins = zeros is not None and zeros.is_floating_point()
    z = zeros if zeros is not None else scales
    block_k = BLOCK_K if K % BLOCK_K == 0 else 8
    _dequant_kernel[(K // block_k, triton.cdiv(N, BLOCK_N))](
        qweight, scales, z, out, N, group, qweight.stride(0), scales.stride(0), z.stride(0), out.stride(0),
        FOUR_BIT=four_bit, HAS_ZEROS=zeros is not None and not mins, HAS_MINS=mins, FAST=qweight.is_cuda,
        BLOCK_K=block_k, BLOCK_N=BLOCK_N, num_warps=4)
    return out
