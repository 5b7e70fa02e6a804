"""RMSNorm with an optional residual add, in one launch.

Hugging Face Llama numerics: with a residual, `h = x + residual` rounded to x's dtype (the new residual);
`out = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`: normalized in fp32, rounded to the input dtype,
then multiplied by the weight in the (promoted) weight/input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common

_ROW_ELEMENTS = 2048  # short rows are packed several to a program, up to this many elements


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`."""
    if residual is not None:
        residual = x + residual
        x = residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)
    return out if residual is None else (out, residual)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, num_rows, hidden, eps,
    stride_x, stride_r, stride_out, stride_r_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
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
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = common.to_dtype(h + r, x_ptr.dtype.element_ty, FAST)
        tl.store(r_out_ptr + rows[:, None] * stride_r_out + cols[None, :], h, mask=mask)
        h = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / hidden + eps)
    normed = common.to_dtype(h * rstd[:, None], x_ptr.dtype.element_ty, FAST).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    out = common.to_dtype(normed * w[None, :], out_ptr.dtype.element_ty, FAST)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton `rms_norm_ref`: fresh output tensors (the residual is not updated in place); rows of x and
    residual may be strided, their last dimension is made contiguous if it is not."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    r_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    out2, r_out2 = out.view(-1, hidden), r_out.view(-1, hidden)
    num_rows = x2.shape[0]
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        block_m = max(1, min(16, _ROW_ELEMENTS // block))
        _rms_norm_kernel[(triton.cdiv(num_rows, block_m),)](
            x2, r2, weight.contiguous(), out2, r_out2, num_rows, hidden, float(eps),
            x2.stride(0), r2.stride(0), out2.stride(0), r_out2.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK=block,
            num_warps=4 if block <= 2048 else (8 if block <= 4096 else 16), **common.launch_options(x),
        )
    return out if residual is None else (out, r_out)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as `[rows, hidden]` with a unit last stride: a view when possible (strided rows are kept)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
