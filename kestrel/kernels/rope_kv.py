"""Rotary embedding of q and k fused with the paged KV-cache write, in one launch.

Neox layout: in each head the two halves of the first `rotary_dim` dims rotate together
(`x1 * cos - x2 * sin`, `x2 * cos + x1 * sin`) by the position's angles; dims past `rotary_dim` pass through.
The rotation is done in fp32 with the fp32 cos/sin tables and rounded once: rotated q to q's dtype (a new
contiguous tensor), rotated k straight into the K cache (rounded to the cache's dtype, or stored as
k / k_scale saturated to +-448 in an FP8 cache, like `store_kv`). V is written as `store_kv` writes it. Rows
whose slot is -1 write nothing into either cache; their q is still rotated.

With `head_norms` each head of q and of k is first RMS-normalised over its dims (Qwen3's and Gemma 3's q/k norms),
with the numerics of `norm.rms_norm` on rows of one head (its output rounded to q's dtype, then rotated): the
fused launch (launch feature `rope_head_norms`; off, the launcher runs the two norm launches first) replaces two
norm launches, and differs from them at most where a sum of squares adds in another order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common
from kestrel.kernels.attention import check_staged_kv, staged_kv_ref, stages_fp8, stages_v_in_pairs
from kestrel.kernels.norm import rms_norm, rms_norm_ref
from kestrel.kernels.store_kv import store_kv_ref

_GROUP_ELEMENTS = 1024  # (head, dim) elements per program
V_TRANSPOSED_TOKENS = 64  # tokens per program of the transposed V staging: 64-byte runs of an e4m3 row


class HeadNorms(NamedTuple):
    """Per-head RMSNorm weights `[head_size]` of q and k, applied before the rotation; `unit_offset`: Gemma's
    `norm(x) * (1 + weight)`."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool = False


def head_norms_ref(q: torch.Tensor, k: torch.Tensor, norms: HeadNorms, head_size: int,
                   rms_norm=rms_norm_ref) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k with each head normalised by `rms_norm` (its rows one head each), in their shapes."""
    return tuple(rms_norm(x.reshape(-1, head_size), w, norms.eps, unit_offset=norms.unit_offset).view(x.shape)
                 for x, w in ((q, norms.q_weight), (k, norms.k_weight)))


def rope_store_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    head_norms: HeadNorms | None = None,
    staged: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q `[T, H*D]`, k and v `[T, H_kv*D]`, caches `[num_blocks, block_size, H_kv, D]` -> rotated q `[T, H*D]`.
    `staged` (`attention.new_staged_kv`'s pair): filled with the rows as written (`attention.staged_kv_ref`), for
    the prefill attention launch to read in token order."""
    num_tokens, head_size = q.shape[0], k_cache.shape[-1]
    if head_norms is not None:
        q, k = head_norms_ref(q, k, head_norms, head_size)
    cos = cos_cache[positions].float().unsqueeze(1)  # [T, 1, rotary_dim // 2]
    sin = sin_cache[positions].float().unsqueeze(1)
    k_rot = _rotate_ref(k, cos, sin, rotary_dim, head_size)
    store_kv_ref(k_rot, v.reshape(num_tokens, -1, head_size), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    fill_staged(staged, k_cache, v_cache, slot_mapping)
    return _rotate_ref(q, cos, sin, rotary_dim, head_size).to(q.dtype).reshape(num_tokens, -1)


def fill_staged(staged: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Copy the rows just written (`attention.staged_kv_ref`) into `staged`, where given: the paths without a
    fused staging write."""
    if staged is not None:
        for dst, src in zip(staged, staged_kv_ref(k_cache, v_cache, slot_mapping)):
            dst.view(torch.uint8).copy_(src.view(torch.uint8))  # bytes: no FP8 copy kernel on every device


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                head_size: int) -> torch.Tensor:
    """fp32 `[T, heads, head_size]`."""
    x = x.float().reshape(x.shape[0], -1, head_size)
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit
def _normed(x, rstd, w_ptr, cols, UNIT_OFFSET: tl.constexpr, FAST: tl.constexpr, dtype: tl.constexpr):
    """`norm.rms_norm`'s output for the values `x` of columns `cols` of their rows, back in fp32."""
    w = tl.load(w_ptr + cols).to(tl.float32)[None, :]
    if UNIT_OFFSET:
        y = common.to_dtype(x * rstd[:, None] * (1.0 + w), dtype, FAST)
    else:
        y = common.to_dtype(common.to_dtype(x * rstd[:, None], dtype, FAST).to(tl.float32) * w, dtype, FAST)
    return y.to(tl.float32)


@triton.jit
def _rotated(row_ptr, h, d, mask, cos, sin, norm_w_ptr, eps, HALF: tl.constexpr, HEAD: tl.constexpr,
             NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, FAST: tl.constexpr):
    """fp32 rotated `[GROUP, HEAD_PAD]` tile of heads `h` of one token row (0 where masked), each head first
    RMS-normalised by the weights at `norm_w_ptr` when NORM."""
    first = d < HALF
    rot = d < 2 * HALF
    partner = tl.where(first, d + HALF, d - HALF)
    x = tl.load(row_ptr + h[:, None] * HEAD + d[None, :], mask=mask, other=0.0).to(tl.float32)
    p = tl.load(row_ptr + h[:, None] * HEAD + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    if NORM:
        dtype: tl.constexpr = row_ptr.dtype.element_ty
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD + eps)
        x = _normed(x, rstd, norm_w_ptr, tl.minimum(d, HEAD - 1), UNIT_OFFSET, FAST, dtype)
        p = _normed(p, rstd, norm_w_ptr, tl.minimum(partner, HEAD - 1), UNIT_OFFSET, FAST, dtype)
    y = tl.where(first[None, :], x * cos[None, :] - p * sin[None, :], x * cos[None, :] + p * sin[None, :])
    return tl.where(rot[None, :], y, x)


# Positions and slots are slices of the step's buffers at any offset: specialized on their alignment, a launch
# compiled again while serving for each new offset (see attention._paged_attn_kernel).
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_store_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_norm_ptr, k_norm_ptr, staged_k_ptr, staged_v_ptr, k_scale, v_scale, norm_eps,
    stride_q, stride_k, stride_v, stride_qo, stride_cos, stride_sin,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_sk, stride_sv,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    HALF: tl.constexpr, GROUP: tl.constexpr, Q_GROUPS: tl.constexpr, KV_GROUPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, K_FP8: tl.constexpr, V_FP8: tl.constexpr, NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, USE_PDL: tl.constexpr, FAST: tl.constexpr, STAGE: tl.constexpr,
    STAGE_V_PAIRS: tl.constexpr,
):
    """Program (token, group): groups of GROUP heads, first those of q, then k, then v (none of v where V is staged
    transposed: `_store_v_transposed_kernel` writes it). STAGE: the K and V rows as written also go to the staged
    rows (zeros where the slot is -1), V's dims per head evens first with STAGE_V_PAIRS."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    d = tl.arange(0, HEAD_PAD)
    if g < Q_GROUPS + KV_GROUPS:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        j = tl.where(d < HALF, d, d - HALF)
        rot = d < 2 * HALF
        cos = tl.load(cos_ptr + pos * stride_cos + j, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_sin + j, mask=rot, other=0.0).to(tl.float32)
        if g < Q_GROUPS:
            h = g * GROUP + tl.arange(0, GROUP)
            mask = (h < NUM_HEADS)[:, None] & (d < HEAD)[None, :]
            y = _rotated(q_ptr + t * stride_q, h, d, mask, cos, sin, q_norm_ptr, norm_eps, HALF, HEAD, NORM,
                         UNIT_OFFSET, FAST)
            tl.store(q_out_ptr + t * stride_qo + h[:, None] * HEAD + d[None, :],
                     common.to_dtype(y, q_out_ptr.dtype.element_ty, FAST), mask=mask)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            h = (g - Q_GROUPS) * GROUP + tl.arange(0, GROUP)
            mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD)[None, :]
            y = _rotated(k_ptr + t * stride_k, h, d, mask, cos, sin, k_norm_ptr, norm_eps, HALF, HEAD, NORM,
                         UNIT_OFFSET, FAST)
            dst = (k_cache_ptr + (slot // BLOCK_SIZE) * stride_kcb + (slot % BLOCK_SIZE) * stride_kct
                   + h[:, None] * stride_kch + d[None, :])
            stored = common.to_cache(y, k_scale, k_cache_ptr.dtype.element_ty, K_FP8, FAST)
            tl.store(dst, stored, mask=mask & (slot >= 0))
            if STAGE:
                staged = tl.where(slot >= 0, stored.to(staged_k_ptr.dtype.element_ty), 0.0)
                tl.store(staged_k_ptr + t * stride_sk + h[:, None] * HEAD + d[None, :], staged, mask=mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = (g - Q_GROUPS - KV_GROUPS) * GROUP + tl.arange(0, GROUP)
        head_mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD)[None, :]
        mask = head_mask & (slot >= 0)
        x = tl.load(v_ptr + t * stride_v + h[:, None] * HEAD + d[None, :], mask=mask, other=0.0).to(tl.float32)
        dst = (v_cache_ptr + (slot // BLOCK_SIZE) * stride_vcb + (slot % BLOCK_SIZE) * stride_vct
               + h[:, None] * stride_vch + d[None, :])
        stored = common.to_cache(x, v_scale, v_cache_ptr.dtype.element_ty, V_FP8, FAST)
        tl.store(dst, stored, mask=mask)
        if STAGE:
            col = (d % 2) * (HEAD // 2) + d // 2 if STAGE_V_PAIRS else d
            staged_at = t * stride_sv + h[:, None] * HEAD + col[None, :]
            tl.store(staged_v_ptr + staged_at, stored.to(staged_v_ptr.dtype.element_ty), mask=head_mask)


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ptr"])
def _store_v_transposed_kernel(
    v_ptr, slot_ptr, v_cache_ptr, staged_v_ptr, v_scale, num_tokens,
    stride_v, stride_vcb, stride_vct, stride_vch, stride_sv,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, V_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr, FAST: tl.constexpr,
):
    """Program (block of BLOCK_T tokens, KV head): V written into the cache as `_rope_store_kv_kernel` writes it,
    and into the staged V transposed (token t its column t; zeros where the slot is -1). A block of tokens per
    program makes the transposed store contiguous along the tokens; one token per program wrote a byte per row.
    Only the last block masks its tokens: a mask that varies along the tokens (against an unspecialized count)
    splits the transposed store into single bytes."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    t0 = tl.program_id(0) * BLOCK_T
    h = tl.program_id(1)
    if t0 + BLOCK_T <= num_tokens:
        _store_v_block(v_ptr, slot_ptr, v_cache_ptr, staged_v_ptr, v_scale, t0, h, num_tokens, stride_v, stride_vcb,
                       stride_vct, stride_vch, stride_sv, HEAD, HEAD_PAD, BLOCK_SIZE, V_FP8, BLOCK_T, False, FAST)
    else:
        _store_v_block(v_ptr, slot_ptr, v_cache_ptr, staged_v_ptr, v_scale, t0, h, num_tokens, stride_v, stride_vcb,
                       stride_vct, stride_vch, stride_sv, HEAD, HEAD_PAD, BLOCK_SIZE, V_FP8, BLOCK_T, True, FAST)


@triton.jit
def _store_v_block(v_ptr, slot_ptr, v_cache_ptr, staged_v_ptr, v_scale, t0, h, num_tokens, stride_v, stride_vcb,
                   stride_vct, stride_vch, stride_sv, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, V_FP8: tl.constexpr, BLOCK_T: tl.constexpr, TAIL: tl.constexpr,
                   FAST: tl.constexpr):
    t = t0 + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HEAD_PAD)
    if TAIL:
        t_ok = t < num_tokens
        slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
        head_mask = t_ok[:, None] & (d < HEAD)[None, :]
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        head_mask = tl.full([BLOCK_T, 1], True, tl.int1) & (d < HEAD)[None, :]
    mask = head_mask & (slot >= 0)[:, None]
    x = tl.load(v_ptr + t.to(tl.int64)[:, None] * stride_v + h * HEAD + d[None, :], mask=mask, other=0.0)
    stored = common.to_cache(x.to(tl.float32), v_scale, v_cache_ptr.dtype.element_ty, V_FP8, FAST)
    dst = (v_cache_ptr + (slot // BLOCK_SIZE)[:, None] * stride_vcb + (slot % BLOCK_SIZE)[:, None] * stride_vct
           + h * stride_vch + d[None, :])
    tl.store(dst, stored, mask=mask)
    staged = tl.trans(stored.to(staged_v_ptr.dtype.element_ty))
    tl.store(staged_v_ptr + (h * HEAD + d)[:, None] * stride_sv + t[None, :], staged, mask=tl.trans(head_mask))


def rope_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    head_norms: HeadNorms | None = None,
    staged: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton `rope_store_kv_ref`. q, k and v may be column slices of one qkv tensor (strided rows)."""
    num_tokens = q.shape[0]
    _, block_size, num_kv_heads, head_size = k_cache.shape
    num_heads = q.shape[-1] // head_size
    q, k, v = (_rows(x, num_tokens) for x in (q, k, v))
    half = rotary_dim // 2
    if q.shape[1] != num_heads * head_size or k.shape[1] != num_kv_heads * head_size or v.shape[1] != k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit heads of "
                         f"{head_size} and a cache of {num_kv_heads} KV heads")
    if rotary_dim % 2 or rotary_dim > head_size or cos_cache.shape[-1] != half or sin_cache.shape[-1] != half:
        raise ValueError(f"rotary_dim {rotary_dim} does not fit head size {head_size} and cos/sin tables of "
                         f"{cos_cache.shape[-1]} / {sin_cache.shape[-1]} columns")
    if any(x.stride(-1) != 1 for x in (cos_cache, sin_cache, k_cache, v_cache)):
        raise ValueError("the cos/sin tables and the caches must have a contiguous last dimension")
    if head_norms is not None:
        _check_head_norms(head_norms, q, k, head_size)
        if not common.launch_feature("rope_head_norms", q.device):  # the norms' own launches, as measured before
            q, k = head_norms_ref(q, k, head_norms, head_size, rms_norm=rms_norm)
            head_norms = None
    if staged is not None:
        check_staged_kv(staged, num_tokens, k_cache)
    q_out = torch.empty((num_tokens, num_heads * head_size), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    head_pad = triton.next_power_of_2(head_size)
    group = min(triton.next_power_of_2(num_kv_heads), max(1, _GROUP_ELEMENTS // head_pad))
    q_groups, kv_groups = triton.cdiv(num_heads, group), triton.cdiv(num_kv_heads, group)
    fp8 = torch.float8_e4m3fn
    v_transposed = staged is not None and stages_fp8(k_cache, num_tokens)
    _rope_store_kv_kernel[(num_tokens, q_groups + (1 if v_transposed else 2) * kv_groups)](
        positions, q, k, v, cos_cache, sin_cache, q_out, k_cache, v_cache, slot_mapping,
        head_norms.q_weight if head_norms else q, head_norms.k_weight if head_norms else k,
        staged[0] if staged else q, staged[1] if staged else q,
        float(k_scale), float(v_scale), float(head_norms.eps) if head_norms else 0.0,
        q.stride(0), k.stride(0), v.stride(0), q_out.stride(0), cos_cache.stride(0), sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), staged[0].stride(0) if staged else 0, staged[1].stride(0) if staged else 0,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD=head_size, HEAD_PAD=head_pad, HALF=half,
        GROUP=group, Q_GROUPS=q_groups, KV_GROUPS=kv_groups, BLOCK_SIZE=block_size,
        K_FP8=k_cache.dtype == fp8, V_FP8=v_cache.dtype == fp8, NORM=head_norms is not None,
        UNIT_OFFSET=bool(head_norms and head_norms.unit_offset), STAGE=staged is not None,
        STAGE_V_PAIRS=staged is not None and stages_v_in_pairs(k_cache, num_tokens), num_warps=4,
        **common.launch_options(q),
    )
    if v_transposed:
        _store_v_transposed_kernel[(triton.cdiv(num_tokens, V_TRANSPOSED_TOKENS), num_kv_heads)](
            v, slot_mapping, v_cache, staged[1], float(v_scale), num_tokens,
            v.stride(0), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), staged[1].stride(0),
            HEAD=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, V_FP8=v_cache.dtype == fp8,
            BLOCK_T=V_TRANSPOSED_TOKENS, num_warps=4, **common.launch_options(q),
        )
    return q_out


def _check_head_norms(norms: HeadNorms, q: torch.Tensor, k: torch.Tensor, head_size: int) -> None:
    for name, w, x in (("q", norms.q_weight, q), ("k", norms.k_weight, k)):
        if w.shape != (head_size,) or w.dtype != x.dtype or not w.is_contiguous():
            raise ValueError(f"head_norms: the {name} weight must be a contiguous [{head_size}] tensor of "
                             f"{x.dtype}, got {tuple(w.shape)} {w.dtype}")


def _rows(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`[T, heads * D]` with a unit last stride; strided rows are kept."""
    if x.dim() != 2:
        x = x.reshape(num_tokens, -1)
    return x if x.stride(-1) == 1 else x.contiguous()
