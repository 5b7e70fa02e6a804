"""The W8A8 block GEMM of block-FP8 checkpoints (DeepSeek-V3's and the Qwen3 FP8 releases' layout): e4m3 activations
with one scale per token and `group` input features, e4m3 weights `[N, K]` with one scale per output row and `group`
input features (a checkpoint's `[bn, bk]` block scales repeated over their `bn` rows, as the loader holds them).

    out[m, n] = sum_g scale_a[m, g] * scale_b[n, g] * sum_{k in g} a[m, k] * b[n, k]  (+ bias[n])

`block_fp8_mm`: one program per `[BLOCK_M, BLOCK_N]` output tile (grouped order for L2 reuse), K walked in steps of
`BLOCK_K` that divide the group, each step's fp32 dot scaled by its group's two scales and added: the products are
exact in fp32 (e4m3 x e4m3), their sums and the scaling rounded as the reference's are up to order. A last group
shorter than `group` (K no multiple of it) is masked. `block_fp8_mm_ref`: the same sums in fp32, group by group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.kernels import common

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class BlockMMConfig:
    """One launch of the block GEMM: the output tile, its warps and pipeline stages, and how many row tiles sweep
    the column tiles together (`group_m`)."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, entry: dict) -> BlockMMConfig:
        return cls(**entry)


DEFAULT_CONFIG = BlockMMConfig()


def select_config(N: int, K: int, M: int, device: torch.device) -> BlockMMConfig:
    """This GPU's entry for the layer `N, K` and M's bucket (`tuning/block_fp8_mm_<gpu>.json`), else the default."""
    entry = common.bucket_entry(common.gpu_table("block_fp8_mm", device).get(f"{N},{K}", {}), M)
    return DEFAULT_CONFIG if entry is None else BlockMMConfig.from_json(entry)


def _check(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group: int,
           bias: torch.Tensor | None) -> None:
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"block_fp8_mm: a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"block_fp8_mm: a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    groups = -(-a.shape[1] // group)
    if tuple(scale_a.shape) != (a.shape[0], groups) or tuple(scale_b.shape) != (b.shape[0], groups):
        raise ValueError(f"block_fp8_mm: scales [M, {groups}] and [N, {groups}] for K={a.shape[1]} in groups of "
                         f"{group}, got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    if bias is not None and tuple(bias.shape) != (b.shape[0],):
        raise ValueError(f"block_fp8_mm: bias [N], got {tuple(bias.shape)}")


def k_step(group: int) -> int:
    """The kernel's K step for groups of `group` input features; ValueError where none fits."""
    step = min(group & -group, 128)
    if step < 32:
        raise ValueError(f"block_fp8_mm: groups of {group} input features; the kernel steps K by a power of two "
                         "from 32 (an e4m3 tensor-core dot's least K) to 128 that divides the group, and none does")
    return step


def block_fp8_mm_ref(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group: int,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 reference: each group's exact products summed, scaled by its two scales, the groups added in order."""
    _check(a, b, scale_a, scale_b, group, bias)
    K = a.shape[1]
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for g, k in enumerate(range(0, K, group)):
        part = a[:, k:k + group].float() @ b[:, k:k + group].float().T
        out += part * scale_a[:, g:g + 1].float() * scale_b[:, g].float()[None, :]
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


@triton.jit
def _block_fp8_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                         stride_sa, stride_sb, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row tiles sweep the column tiles together, sharing the weight tiles through L2.
    _, _, rows, cols = common.gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    row_ok = rows < M
    col_ok = cols < N
    rows_c = tl.where(row_ok, rows, 0)
    cols_c = tl.where(col_ok, cols, 0)
    ks = tl.arange(0, BLOCK_K)
    # Pointer tiles made once and stepped along K (made anew each step, they held two 64-bit tiles in registers).
    a_ptrs = a_ptr + rows_c.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols_c.to(tl.int64)[None, :] * stride_bn + ks[:, None]
    sa_ptrs = sa_ptr + rows_c * stride_sa
    sb_ptrs = sb_ptr + cols_c * stride_sb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        g = k // GROUP
        sa = tl.load(sa_ptrs + g)
        sb = tl.load(sb_ptrs + g)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_c).to(tl.float32)[None, :]
    out = common.to_dtype(acc, c_ptr.dtype.element_ty, FAST)
    tl.store(c_ptr + rows_c.to(tl.int64)[:, None] * stride_cm + cols[None, :], out,
             mask=row_ok[:, None] & col_ok[None, :])


def block_fp8_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group: int,
                 out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                 config: BlockMMConfig | None = None) -> torch.Tensor:
    """Triton `block_fp8_mm_ref`. Tiles of `config` (default: this GPU's table entry for the shape, else 64 x 128),
    K in steps of the largest power of two up to 128 that divides the group (128 for the published checkpoints'
    blocks), at least 32 (an e4m3 tensor-core dot's least K)."""
    _check(a, b, scale_a, scale_b, group, bias)
    block_k = k_step(group)
    M, K = a.shape
    N = b.shape[0]
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    scale_a, scale_b = scale_a.float().contiguous(), scale_b.float().contiguous()
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    cfg = config if config is not None else select_config(N, K, M, a.device)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _block_fp8_mm_kernel[grid](a, b, out, scale_a, scale_b, bias if bias is not None else scale_b, M, N, K,
                               a.stride(0), b.stride(0), out.stride(0), scale_a.stride(0), scale_b.stride(0),
                               GROUP=group, HAS_BIAS=bias is not None, FAST=a.is_cuda, BLOCK_M=cfg.block_m,
                               BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages)
    return out
