"""Write K and V into the paged cache by slot mapping (slot -1 writes nothing)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value `[num_tokens, num_kv_heads, head_size]` into caches `[num_blocks, block_size, H_kv, D]`.

    An FP8 cache stores value / scale, saturated to the e4m3 range.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = _to_cache_dtype(key[valid], k_cache.dtype, k_scale)
    v_flat[slots] = _to_cache_dtype(value[valid], v_cache.dtype, v_scale)


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:
        limit = torch.finfo(torch.float8_e4m3fn).max
        return (x.float() / scale).clamp(-limit, limit).to(dtype)
    return x.to(dtype)


# ------------------------------------------------------------------------------------------------ Triton

_FP8_MAX = {torch.float8_e4m3fn: 448.0}  # the dtypes store_kv_ref quantizes


@triton.jit
def _write(src_ptr, dst_ptr, offs_src, offs_dst, mask, scale, FP8_MAX: tl.constexpr):
    x = tl.load(src_ptr + offs_src, mask=mask)
    if FP8_MAX > 0:
        y = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
        tl.store(dst_ptr + offs_dst, y.to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst_ptr + offs_dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """BLOCK_T tokens x all their (head, dim) elements, flattened to WIDTH columns."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    col = tl.arange(0, WIDTH)
    h = col // HEAD_PAD
    d = col % HEAD_PAD
    mask = (slot >= 0)[:, None] & ((h < NUM_KV_HEADS) & (d < HEAD))[None, :]
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    t64 = t.to(tl.int64)[:, None]
    _write(key_ptr, k_cache_ptr, t64 * stride_kt + (h * stride_kh + d)[None, :],
           (blk * stride_kcb + off * stride_kct)[:, None] + (h * stride_kch + d)[None, :], mask, k_scale, FP8_MAX)
    _write(value_ptr, v_cache_ptr, t64 * stride_vt + (h * stride_vh + d)[None, :],
           (blk * stride_vcb + off * stride_vct)[:, None] + (h * stride_vch + d)[None, :], mask, v_scale, FP8_MAX)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton `store_kv_ref`: a few tokens per program; rows with slot -1 are masked out entirely."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("key, value and the caches must have a contiguous last dimension")
    head_pad = triton.next_power_of_2(head_size)
    width = triton.next_power_of_2(num_kv_heads) * head_pad
    block_t = max(1, min(16, 4096 // width))
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD=head_size, HEAD_PAD=head_pad, WIDTH=width, BLOCK_T=block_t,
        BLOCK_SIZE=k_cache.shape[1], FP8_MAX=_FP8_MAX.get(k_cache.dtype, 0.0), num_warps=4,
    )
