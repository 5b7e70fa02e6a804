"""FP8 weight GEMV for decode-sized linear layers (M <= 8 rows): W8A16 numerics, one launch.

A W8A8 linear at batch 1 runs an activation-quantizer launch and a tensor-core GEMM tiled for many rows; both
cost more than reading the weights. Here each program streams `[BLOCK_N, BLOCK_K]` tiles of the float8_e4m3fn
weight `[N, K]` (K contiguous, the layout the W8A8 layers hold) with wide loads along K, converts them to fp32 in
registers and multiplies them by the model-dtype activations `x [M, K]` (unquantized), accumulating elementwise in
fp32 `[BLOCK_M, BLOCK_N, BLOCK_K]` (one FMA per weight and row, no tensor cores) and reducing over K once at the
end. The per-channel (or per-tensor) weight scale and the bias are applied to the fp32 sums, rounded once.

`dot_from_m` (0: never): from that M on (16-bit activations only) each step is a tensor-core `tl.dot` of the rows
padded to 16 against the tile converted to the activations' dtype (exact: every e4m3 value is a bf16 and an fp16
value) instead of the elementwise FMA, whose `[BLOCK_M, BLOCK_N, BLOCK_K]` accumulator outgrows the registers as
M grows. The products are exact either way and the sums fp32; only their order differs.

`split_k > 1`: programs over (N blocks, K splits), each writing its fp32 partial sums to a `[split_k, M, N]`
workspace, and a second launch that sums the splits in order, scales, adds the bias and rounds (no atomics).

Numerics, shared by `fp8_gemv_ref`: `out = (x @ (weight * scale).T) + bias` in fp32, rounded once to `out_dtype`;
the activations are not quantized (more exact than W8A8 by the activations' e4m3 error).

Which layers take it, and up to which M: `select_gemv` reads the per-GPU table `tuning/fp8_gemv_<gpu>.json`
(written by scripts/h200_fp8_gemv.py), keyed by the weight's `(N, K)`; without an entry the path is off.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from kestrel.kernels import common
from kestrel.kernels import moe_common as _mc

TABLE = "fp8_gemv"
MAX_M = 8


@dataclass(frozen=True)
class FP8GemvConfig:
    """Launch tiles. `max_m`: the GEMV is chosen for 1 <= M <= max_m (0: never); the tiles apply at any M."""

    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    max_m: int = 0
    dot_from_m: int = 0  # tensor-core steps from this M on (16-bit activations); 0: the FMA loop at every M

    def to_json(self) -> dict:
        return asdict(self)


DEFAULT = FP8GemvConfig()


def table_key(N: int, K: int) -> str:
    return f"{N},{K}"


def table_config(N: int, K: int, device: torch.device) -> FP8GemvConfig | None:
    """The GPU table's config for a weight `[N, K]`, or None (no table, or no entry for the shape)."""
    entry = common.gpu_table(TABLE, device).get(table_key(N, K))
    return None if entry is None else FP8GemvConfig(**entry)


def takes_rows(cfg: FP8GemvConfig | None, M: int) -> bool:
    """Whether a layer whose table config is `cfg` runs `M` rows on this path."""
    return cfg is not None and 1 <= M <= min(cfg.max_m, MAX_M)


def select_gemv(M: int, N: int, K: int, device: torch.device) -> FP8GemvConfig | None:
    """The config to run `M` rows of a `[N, K]` FP8 weight with on this path, or None for W8A8."""
    cfg = table_config(N, K, device)
    return cfg if takes_rows(cfg, M) else None


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemv: weight must be float8_e4m3fn, got {weight.dtype}")
    M, K = x.shape
    N = weight.shape[0]
    if weight_scale.numel() not in (1, N):
        raise ValueError(f"fp8_gemv: weight_scale has {weight_scale.numel()} elements; expected 1 or N={N}")
    if bias is not None and bias.numel() != N:
        raise ValueError(f"fp8_gemv: bias has {bias.numel()} elements; expected N={N}")
    return M, N, K


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype,
                 bias: torch.Tensor | None = None, *, config: FP8GemvConfig | None = None) -> torch.Tensor:
    """PyTorch reference in fp32: `x @ (weight * scale).T + bias`, rounded once. `config` is unused."""
    _check(x, weight, weight_scale, bias)
    scale = weight_scale.float().reshape(-1, 1)
    out = x.float() @ (weight.float() * scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------------- kernels


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, k_per_split,
                 stride_xm, stride_wn, stride_om, stride_os,
                 PER_TENSOR: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
                 FAST: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out[m, n] = round(scale[n] * sum_k x[m, k] * w[n, k] + bias[n]) over this program's N block; PARTIAL: the
    unscaled fp32 sum over split `program_id(1)`'s K range, to out[split, m, n]. DOT: tensor-core steps (x 16-bit,
    BLOCK_M >= 16) instead of the elementwise FMA accumulator."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    # Wrapped rows keep the weight loads in bounds without an N mask; their results are not stored.
    rows = (cols % N).to(tl.int64)
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rows[:, None] * stride_wn
    x_rows = x_ptr + ms[:, None].to(tl.int64) * stride_xm
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        offs = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = _mc._load(w_rows + offs[None, :], None, False, True)
            xv = tl.load(x_rows + offs[None, :], mask=m_ok[:, None], other=0.0)
        else:
            k_ok = offs < k_hi
            w = _mc._load(w_rows + offs[None, :], k_ok[None, :], True, True)
            xv = tl.load(x_rows + offs[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            if FAST:
                acc = tl.dot(xv, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
            else:  # the interpreter's 16-bit dot is wrong; in fp32 the same exact products
                acc = tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc += w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :]
    if DOT:
        dot = acc
    else:
        dot = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    mask = m_ok[:, None] & (cols < N)[None, :]
    if PARTIAL:
        ptrs = out_ptr + split.to(tl.int64) * stride_os + ms[:, None] * stride_om + cols[None, :]
        tl.store(ptrs, dot, mask=mask)
    else:
        if PER_TENSOR:
            scale = tl.load(s_ptr)
        else:
            scale = tl.load(s_ptr + rows)[None, :]
        y = dot * scale
        if HAS_BIAS:
            y += tl.load(b_ptr + rows).to(tl.float32)[None, :]
        ptrs = out_ptr + ms[:, None] * stride_om + cols[None, :]
        tl.store(ptrs, common.to_dtype(y, out_ptr.dtype.element_ty, FAST), mask=mask)


@triton.jit
def _reduce_kernel(part_ptr, s_ptr, b_ptr, out_ptr, M, N, stride_pm, stride_ps, stride_om,
                   SPLIT_K: tl.constexpr, PER_TENSOR: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[m, n] = round(scale[n] * sum_s part[s, m, n] + bias[n]), the splits summed in order."""
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        dot += tl.load(part_ptr + s * stride_ps + m * stride_pm + cols, mask=ok, other=0.0)
    if PER_TENSOR:
        scale = tl.load(s_ptr)
    else:
        scale = tl.load(s_ptr + cols, mask=ok, other=0.0)
    y = dot * scale
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, common.to_dtype(y, out_ptr.dtype.element_ty, FAST), mask=ok)


# ----------------------------------------------------------------------------------------- launcher


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None, *, config: FP8GemvConfig | None = None) -> torch.Tensor:
    """Triton `fp8_gemv_ref`; see the module docstring. Any M works (the tiles are sized for a few rows; more
    than `MAX_M` run in chunks). No host sync: capturable in a CUDA graph."""
    M, N, K = _check(x, weight, weight_scale, bias)
    cfg = config or DEFAULT
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(fp8_gemv_ref(x, weight, weight_scale, out_dtype, bias))
    if weight.stride(1) != 1:
        raise ValueError("fp8_gemv: weight must be contiguous along K")
    x = x if x.stride(1) == 1 else x.contiguous()
    scale = weight_scale.reshape(-1).float().contiguous()
    per_tensor = scale.numel() == 1
    b = bias.contiguous() if bias is not None else scale  # a placeholder the kernel never reads
    block_k = min(cfg.block_k, triton.next_power_of_2(K))
    split_k = max(1, min(cfg.split_k, triton.cdiv(K, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    even_k = K % block_k == 0  # every split starts on a BLOCK_K multiple, so only the last step can be partial
    fast = x.is_cuda
    for m0 in range(0, M, MAX_M):
        xm, om = x[m0:m0 + MAX_M], out[m0:m0 + MAX_M]
        rows = xm.shape[0]
        # Tensor-core steps need 16-bit activations and tiles of at least 16; otherwise the FMA loop runs.
        use_dot = (0 < cfg.dot_from_m <= rows and x.dtype in (torch.bfloat16, torch.float16)
                   and cfg.block_n >= 16 and block_k >= 16)
        block_m = max(16, triton.next_power_of_2(rows)) if use_dot else triton.next_power_of_2(rows)
        grid = (triton.cdiv(N, cfg.block_n), split_k)
        if split_k == 1:
            _gemv_kernel[grid](xm, weight, scale, b, om, rows, N, K, k_per_split,
                               xm.stride(0), weight.stride(0), om.stride(0), 0,
                               PER_TENSOR=per_tensor, HAS_BIAS=bias is not None, PARTIAL=False, EVEN_K=even_k,
                               FAST=fast, DOT=use_dot, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                               NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
            continue
        part = torch.empty(split_k, rows, N, dtype=torch.float32, device=x.device)
        _gemv_kernel[grid](xm, weight, scale, b, part, rows, N, K, k_per_split,
                           xm.stride(0), weight.stride(0), part.stride(1), part.stride(0),
                           PER_TENSOR=per_tensor, HAS_BIAS=False, PARTIAL=True, EVEN_K=even_k,
                           FAST=fast, DOT=use_dot, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                           NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
        block = min(1024, triton.next_power_of_2(N))
        _reduce_kernel[(rows, triton.cdiv(N, block))](
            part, scale, b, om, rows, N, part.stride(1), part.stride(0), om.stride(0),
            SPLIT_K=split_k, PER_TENSOR=per_tensor, HAS_BIAS=bias is not None, FAST=fast, BLOCK=block,
            num_warps=4 if block >= 512 else 1)
    return out
