"""What the grouped-GEMM MoE (`fused_moe`) and the decode-sized path (`moe_small_t`) share: argument and scale
checks, the FP8 weight dequantization of the references, the tile load and the k-sum kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common

_SUM_BLOCK = 1024  # hidden columns per program of the k-sum
_NONE, _PER_CHANNEL, _BLOCK = 0, 1, 2  # QUANT constexpr: weight quantization of the GEMM
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # ROUND constexpr: the intermediate's dtype


def _dequant_weight_ref(w: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None) -> torch.Tensor:
    """One expert's fp8 `[N, K]` weight times its per-channel `[N]` or block `[ceil(N/bn), ceil(K/bk)]` scales."""
    N, K = w.shape
    if block_shape is None:
        return w.float() * scale.reshape(N, 1).float()
    bn, bk = block_shape
    full = scale.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return w.float() * full


def _check_args(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, block_shape=None,
                reduce_inter_amax=None) -> tuple[int, int, int, int, int, bool]:
    """(T, H, E, I, k, fp8) after checking shapes, dtypes and the FP8 scales."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I] expected, got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    T, H = x.shape
    E, two_i, H13 = w13.shape
    inter = two_i // 2
    if H13 != H or two_i % 2 or tuple(w2.shape) != (E, H, inter):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
                         f" (w13 [E, 2I, H], w2 [E, H, I])")
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8:
        if w2.dtype != torch.float8_e4m3fn or x.dtype not in _ROUND:
            raise ValueError(f"fused_moe: FP8 experts need float8_e4m3fn w13 and w2 and a float32, bfloat16 or "
                             f"float16 x, got {x.dtype}, {w13.dtype}, {w2.dtype}")
        _check_scales(w13_scale, w2_scale, block_shape, E, H, inter)
    else:
        if x.dtype != w13.dtype or x.dtype != w2.dtype:
            raise ValueError(f"fused_moe: x, w13, w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
        if w13_scale is not None or w2_scale is not None or block_shape is not None:
            raise ValueError("fused_moe: w13_scale, w2_scale and block_shape are for float8_e4m3fn experts only")
    if reduce_inter_amax is not None and (not fp8 or block_shape is not None):
        raise ValueError("fused_moe: reduce_inter_amax is for per-channel FP8 experts only")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"fused_moe: topk_weights and topk_ids [T, k] expected with T={T}, got "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    return T, H, E, inter, topk_ids.shape[1], fp8


def _check_scales(w13_scale, w2_scale, block_shape, E: int, H: int, inter: int) -> None:
    if w13_scale is None or w2_scale is None:
        raise ValueError("fused_moe: FP8 experts need w13_scale and w2_scale")
    if w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32:
        raise ValueError(f"fused_moe: w13_scale and w2_scale must be float32, got {w13_scale.dtype}, "
                         f"{w2_scale.dtype}")
    if block_shape is None:
        want13, want2 = (E, 2 * inter), (E, H)
        ok = all(tuple(s.shape) in (want, (*want, 1)) for s, want in ((w13_scale, want13), (w2_scale, want2)))
        what = "per-channel"
    else:
        if len(block_shape) != 2 or min(block_shape) < 1:
            raise ValueError(f"fused_moe: block_shape must be (bn, bk) with positive sizes, got {block_shape}")
        bn, bk = block_shape
        if inter % bn:
            raise ValueError(f"fused_moe: block FP8 needs the intermediate size I={inter} to be a multiple of "
                             f"bn={bn} (gate and up rows must not share a scale block)")
        want13 = (E, triton.cdiv(2 * inter, bn), triton.cdiv(H, bk))
        want2 = (E, triton.cdiv(H, bn), triton.cdiv(inter, bk))
        ok = tuple(w13_scale.shape) == want13 and tuple(w2_scale.shape) == want2
        what = f"block {tuple(block_shape)}"
    if not ok:
        raise ValueError(f"fused_moe: {what} scales must be w13_scale {want13} and w2_scale {want2}, got "
                         f"{tuple(w13_scale.shape)} and {tuple(w2_scale.shape)}")


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr, FP8: tl.constexpr):
    """A tile load, zero-filled where masked; fp8 goes through its bytes (a zero `other` cannot be cast to
    fp8 in the interpreter, and the bytes are the same on the GPU)."""
    if FP8:
        p = ptrs.to(tl.pointer_type(tl.uint8))
        if MASKED:
            v = tl.load(p, mask=mask, other=0)
        else:
            v = tl.load(p)
        v = v.to(tl.float8e4nv, bitcast=True)
    else:
        if MASKED:
            v = tl.load(ptrs, mask=mask, other=0.0)
        else:
            v = tl.load(ptrs)
    return v


@triton.jit
def k_sum(in_ptr, ids_ptr, t, cols, mask, stride, TOP_K: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr):
    """fp32 sum over j of in[t * TOP_K + j, cols] (rows `stride` apart), j in order, pairs of expert -1 left out.
    CACHE: the loads' cache modifier ("" or ".cg" for rows other programs just wrote)."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        ok = mask & (tl.load(ids_ptr + t * TOP_K + j) >= 0)
        acc += tl.load(in_ptr + (t * TOP_K + j) * stride + cols, mask=ok, other=0.0, cache_modifier=CACHE)
    return acc


@triton.jit
def _moe_sum_kernel(in_ptr, ids_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """out[t] = sum_j in[t * TOP_K + j] in fp32 (j in order, pairs of expert -1 left out), rounded once."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = k_sum(in_ptr, ids_ptr, t, cols, mask, H, TOP_K, BLOCK, "")
    tl.store(out_ptr + t * H + cols, common.to_dtype(acc, out_ptr.dtype.element_ty, FAST), mask=mask)
