"""W4A16 on the tensor cores with the weights scaled before the dot: one accumulator chained through every dot.

The looped `wna16` tiles keep their operands exact: each K step's dot runs on the bare codes (c - z) into a fresh
accumulator, which is then scaled by the step's group and added to the running one. That costs every step a
wait for its dots to finish and a pass of FMAs over the whole accumulator tile, so the MMAs never overlap the
next step's unpacking and the tiles ran at 0.3-0.4x cuBLAS BF16 from 256 rows (docs/benchmarks.md).

Here each 16-bit weight is formed in registers as s * (c - z), rounded once to the activations' dtype (what the
dense path `wna16_dequant` writes out, and what cuBLAS then multiplies), and every dot accumulates into one fp32
tile, with no scaling pass. Two forms of a K step (nibble s of word row j holds k = 8j + s):
- one dot (`nibble_dots` off): the eight nibble tensors interleaved into the tile's natural K order, against x's
  columns as they are. Triton keeps this dot asynchronous across steps; it won every measured shape and row count
  (docs/benchmarks.md, "The prescaled W4A16 tiles").
- eight nibble dots (`nibble_dots`): dot s over nibble s of every word, against x's columns 8j + s, which the
  launcher copies once per call into that order (`nibble_order`: within each K step of BLOCK_K, column
  s * BLOCK_K / 8 + j holds x's 8j + s). No interleaving, but Triton waits for each of a loop's several dots
  before the next.

SWAP puts the weights on the tensor cores' 64-row side (`out^T = W^T x^T`): the unpacked weights stay in registers
as the MMA's first operand and only x goes through shared memory; without it the weights are the second operand
and pass through shared memory. Rows as the MMA's N are limited to MAX_SWAP_ROWS.

Which products take it (`takes`): int4 and uint4 (integer zero points), groups of a multiple of BLOCK_K (128)
or one group per column, 16-bit activations, on a GPU (`WNA16Config.prescale`; the interpreter runs the same
kernel with the codes unpacked in fp32, the values identical).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import common
from kestrel.kernels.nibbles import in_k_order, nibbles16

WEIGHT_TYPES = ("int4", "uint4")
MIN_BLOCK_K = 128  # eight dots of BLOCK_K / 8 >= 16, the 16-bit MMA's least K
# With the weights as the first operand, x's rows are the MMA's N: 256 of them gave NaNs on an H100 (Triton 3.6,
# every 8B shape), 128 and fewer were right, so larger row blocks are refused there.
MAX_SWAP_ROWS = 128


def takes(weight_type: str, x_dtype: torch.dtype, mins: bool, group: int, K: int, block_k: int, block_m: int,
          swap_ab: bool) -> bool:
    return (weight_type in WEIGHT_TYPES and x_dtype in (torch.bfloat16, torch.float16) and not mins
            and block_k >= MIN_BLOCK_K and (group == K or group % block_k == 0) and K % block_k == 0
            and block_m >= 16 and not (swap_ab and block_m > MAX_SWAP_ROWS))


def nibble_order(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x's columns in the kernel's order: within each K step of block_k, position s * block_k / 8 + j takes x's
    column 8j + s (nibble s of word row j). One copy kernel (no index tensor: safe to capture in a CUDA graph)."""
    M, K = x.shape
    return x.reshape(M, K // block_k, block_k // 8, 8).transpose(2, 3).reshape(M, K)


@triton.jit
def _codes(words, zz, HAS_ZEROS: tl.constexpr, X_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """The eight nibbles of `words` minus their zero point (8 for int4), in X_DTYPE: nibble s is output s."""
    if ASM:
        w0, w1, w2, w3, w4, w5, w6, w7 = nibbles16(words, zz, HAS_ZEROS, X_DTYPE)
    else:
        if HAS_ZEROS:
            z = zz.to(tl.float32)
        else:
            z = 8.0
        w0 = (((words >> 0) & 15).to(tl.float32) - z).to(X_DTYPE)
        w1 = (((words >> 4) & 15).to(tl.float32) - z).to(X_DTYPE)
        w2 = (((words >> 8) & 15).to(tl.float32) - z).to(X_DTYPE)
        w3 = (((words >> 12) & 15).to(tl.float32) - z).to(X_DTYPE)
        w4 = (((words >> 16) & 15).to(tl.float32) - z).to(X_DTYPE)
        w5 = (((words >> 20) & 15).to(tl.float32) - z).to(X_DTYPE)
        w6 = (((words >> 24) & 15).to(tl.float32) - z).to(X_DTYPE)
        w7 = (((words >> 28) & 15).to(tl.float32) - z).to(X_DTYPE)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _scaled(w, s, DOT_F32: tl.constexpr):
    """Codes `w` times their scales `s` (both 16-bit): the weight, rounded once. DOT_F32: the interpreter, whose
    numpy has no 16-bit arithmetic, forms the same rounded weight through fp32 (where (c - z) * s is exact) and
    hands it on in fp32."""
    if DOT_F32:
        w = (w.to(tl.float32) * s.to(tl.float32)).to(s.dtype).to(tl.float32)
    else:
        w = w * s
    return w


@triton.jit
def _mma(acc, w, x, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    """`acc` plus the weights `w` (`[BLOCK_N, k]` as `_scaled` made them) times the activations `x` (`[BLOCK_M,
    k]`): `[BLOCK_N, BLOCK_M]` with SWAP, else `[BLOCK_M, BLOCK_N]`."""
    if DOT_F32:
        x = x.to(tl.float32)
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=["M", "k_tiles_per_split", "split_k"])
def _tc_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, k_tiles, k_tiles_per_split, split_k, steps_per_group,
    stride_xm, stride_wk, stride_sg, stride_zg, stride_om,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, NIBBLE_DOTS: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tile, split, rows, cols = common.gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # Wrapped indices keep every main-loop load in bounds without masks; their results are never stored.
    x_rows = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm
    w_cols = cols % N
    KC: tl.constexpr = BLOCK_K // 8
    offs_c = tl.arange(0, KC)
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    kt_begin = split * k_tiles_per_split
    kt_end = tl.minimum(kt_begin + k_tiles_per_split, k_tiles)

    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(kt_begin, kt_end, num_stages=STAGES):
        g = kt // steps_per_group
        word_rows = kt * KC + offs_c
        s = tl.load(s_ptr + g * stride_sg + w_cols).to(X_DTYPE)[:, None]
        if HAS_ZEROS:
            z = tl.load(z_ptr + g * stride_zg + w_cols)[:, None]
        else:
            z = w_cols[:, None]
        # The words' tile transposed, `[BLOCK_N, BLOCK_K / 8]`: the weights' side of every dot is `[BLOCK_N, k]`.
        words = tl.load(w_ptr + word_rows.to(tl.int64)[None, :] * stride_wk + w_cols[:, None])
        w0, w1, w2, w3, w4, w5, w6, w7 = _codes(words, z, HAS_ZEROS, X_DTYPE, ASM)
        if NIBBLE_DOTS:
            x_step = x_rows + kt * BLOCK_K + offs_c[None, :]
            acc = _mma(acc, _scaled(w0, s, DOT_F32), tl.load(x_step + 0 * KC), SWAP, DOT_F32)
            acc = _mma(acc, _scaled(w1, s, DOT_F32), tl.load(x_step + 1 * KC), SWAP, DOT_F32)
            acc = _mma(acc, _scaled(w2, s, DOT_F32), tl.load(x_step + 2 * KC), SWAP, DOT_F32)
            acc = _mma(acc, _scaled(w3, s, DOT_F32), tl.load(x_step + 3 * KC), SWAP, DOT_F32)
            acc = _mma(acc, _scaled(w4, s, DOT_F32), tl.load(x_step + 4 * KC), SWAP, DOT_F32)
            acc = _mma(acc, _scaled(w5, s, DOT_F32), tl.load(x_step + 5 * KC), SWAP, DOT_F32)
            acc = _mma(acc, _scaled(w6, s, DOT_F32), tl.load(x_step + 6 * KC), SWAP, DOT_F32)
            acc = _mma(acc, _scaled(w7, s, DOT_F32), tl.load(x_step + 7 * KC), SWAP, DOT_F32)
        else:
            # Nibble s of word j is k = 8j + s: the tile in natural K order, for one dot per step.
            w_step = _scaled(in_k_order(w0, w1, w2, w3, w4, w5, w6, w7), s, DOT_F32)
            acc = _mma(acc, w_step, tl.load(x_rows + kt * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]), SWAP, DOT_F32)
    if SWAP:
        acc = tl.trans(acc)

    common.finish_tile(acc, out_ptr, bias_ptr, ws_ptr, lock_ptr, tile, split, split_k, rows, cols, M, N, stride_om,
                       SPLIT, HAS_BIAS, FAST, BLOCK_M, BLOCK_N)


def tc_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            out: torch.Tensor, bias: torch.Tensor | None, ws: torch.Tensor, *, tiles: int, per_split: int,
            split_k: int, block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int,
            swap_ab: bool, nibble_dots: bool) -> None:
    """`out` = x times the weight (arguments as `wna16.wna16_gemm` checked them, `takes` holds, act-order x already
    in sorted-K order), on `wna16_gemm`'s grid of `tiles` output tiles by `split_k` K splits of `per_split` steps,
    its workspace `ws` holding the split partials."""
    M, K = x.shape
    N = qweight.shape[1]
    if nibble_dots:
        x = nibble_order(x, block_k)
    k_tiles = K // block_k
    group = K // scales.shape[0]
    stage_bytes = (block_m + block_n // 4) * block_k * x.element_size()
    _tc_kernel[(tiles, split_k)](
        x, qweight, scales, zeros if zeros is not None else scales, bias.reshape(-1) if bias is not None else scales,
        out, ws, common.arrival_counters(x.device),
        M, N, k_tiles, per_split, split_k, group // block_k, x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else scales.stride(0), out.stride(0),
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, SPLIT=split_k > 1, SWAP=swap_ab, ASM=x.is_cuda,
        DOT_F32=not x.is_cuda, FAST=x.is_cuda, NIBBLE_DOTS=nibble_dots,
        STAGES=common.stages_that_fit(num_stages, stage_bytes, x.device),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps,
    )
