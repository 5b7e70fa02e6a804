"""RMSNorm and LayerNorm, each with an optional residual add, in one launch.

With a residual, `h = x + residual` is rounded to x's dtype (it is the new residual) and normalized.
- RMSNorm, Hugging Face Llama numerics: `out = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`: normalized in
  fp32, rounded to the input dtype, then multiplied by the weight in the (promoted) weight/input dtype.
- RMSNorm with `unit_offset` (Gemma 1/2/3, HF GemmaRMSNorm): `out = (normed * (1 + weight)).to(dtype)`, all in
  fp32 and rounded once to x's dtype (the stored weight is the offset from 1).
- LayerNorm (torch's `F.layer_norm`, biased variance): `((h - mean) * rsqrt(var + eps) * weight + bias)`
  in fp32, rounded once to x's dtype; weight and bias are optional.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common

_ROW_ELEMENTS = 2048  # short rows are packed several to a program, up to this many elements


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`."""
    if residual is not None:
        residual = x + residual
        x = residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if unit_offset:
        out = (x32 * (1.0 + weight.float())).to(x.dtype)
    else:
        out = weight * x32.to(x.dtype)
    return out if residual is None else (out, residual)


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`."""
    if residual is not None:
        residual = x + residual
        x = residual
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    out = F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)
    return out if residual is None else (out, residual)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, num_rows, hidden, eps,
    stride_x, stride_r, stride_out, stride_r_out,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr, FAST: tl.constexpr,
):
    """BLOCK_M rows per program, each held whole in registers (BLOCK >= hidden)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = _add_residual(h, r_ptr, r_out_ptr, rows, cols, mask, stride_r, stride_r_out, x_ptr.dtype.element_ty, FAST)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / hidden + eps)
    if UNIT_OFFSET:
        w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        out = common.to_dtype(h * rstd[:, None] * (1.0 + w[None, :]), out_ptr.dtype.element_ty, FAST)
    else:
        normed = common.to_dtype(h * rstd[:, None], x_ptr.dtype.element_ty, FAST).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        out = common.to_dtype(normed * w[None, :], out_ptr.dtype.element_ty, FAST)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


@triton.jit
def _add_residual(h, r_ptr, r_out_ptr, rows, cols, mask, stride_r, stride_r_out, dtype: tl.constexpr,
                  FAST: tl.constexpr):
    """h + residual rounded to `dtype`, stored as the new residual; returned as fp32."""
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = common.to_dtype(h + r, dtype, FAST)
    tl.store(r_out_ptr + rows[:, None] * stride_r_out + cols[None, :], h, mask=mask)
    return h.to(tl.float32)


@triton.jit(do_not_specialize=["num_rows"])
def _layer_norm_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, r_out_ptr, num_rows, hidden, eps,
    stride_x, stride_r, stride_out, stride_r_out,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr, FAST: tl.constexpr,
):
    """BLOCK_M rows per program, each held whole in registers (BLOCK >= hidden): mean, then the variance of
    the centred values (two passes over registers, no E[h^2] - mean^2 cancellation)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < hidden
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = _add_residual(h, r_ptr, r_out_ptr, rows, cols, mask, stride_r, stride_r_out, x_ptr.dtype.element_ty, FAST)
    mean = tl.sum(h, axis=1) / hidden
    centred = tl.where(mask, h - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(centred * centred, axis=1) / hidden + eps)
    y = centred * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], common.to_dtype(y, out_ptr.dtype.element_ty, FAST),
             mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton `rms_norm_ref`: fresh output tensors (the residual is not updated in place); rows of x and
    residual may be strided, their last dimension is made contiguous if it is not."""
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    x2, r2, out, r_out, out2, r_out2 = _buffers(x, residual, out_dtype)
    num_rows, hidden = x2.shape
    if num_rows > 0:
        block_m, block, num_warps = _tile(hidden)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_m),)](
            x2, r2, weight.contiguous(), out2, r_out2, num_rows, hidden, float(eps),
            x2.stride(0), r2.stride(0), out2.stride(0), r_out2.stride(0),
            HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK_M=block_m, BLOCK=block,
            num_warps=num_warps, **common.launch_options(x),
        )
    return out if residual is None else (out, r_out)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton `layer_norm_ref`, with `rms_norm`'s conventions for outputs and strides."""
    x2, r2, out, r_out, out2, r_out2 = _buffers(x, residual, x.dtype)
    num_rows, hidden = x2.shape
    if num_rows > 0:
        block_m, block, num_warps = _tile(hidden)
        _layer_norm_kernel[(triton.cdiv(num_rows, block_m),)](
            x2, r2, weight.contiguous() if weight is not None else x2, bias.contiguous() if bias is not None else x2,
            out2, r_out2, num_rows, hidden, float(eps), x2.stride(0), r2.stride(0), out2.stride(0), r_out2.stride(0),
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK=block, num_warps=num_warps, **common.launch_options(x),
        )
    return out if residual is None else (out, r_out)


def _tile(hidden: int) -> tuple[int, int, int]:
    """(rows per program, padded row width, warps): short rows are packed up to _ROW_ELEMENTS per program."""
    block = triton.next_power_of_2(hidden)
    block_m = max(1, min(16, _ROW_ELEMENTS // block))
    return block_m, block, 4 if block <= 2048 else (8 if block <= 4096 else 16)


def _buffers(x: torch.Tensor, residual: torch.Tensor | None, out_dtype: torch.dtype):
    """Inputs as `[rows, hidden]` (x stands in for a missing residual), fresh outputs of x's shape (the output
    stands in for a missing new residual), and the outputs' `[rows, hidden]` views."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    r_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    return x2, r2, out, r_out, out.view(-1, hidden), r_out.view(-1, hidden)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as `[rows, hidden]` with a unit last stride: a view when possible (strided rows are kept)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
