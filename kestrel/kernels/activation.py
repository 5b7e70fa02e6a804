"""SiLU(gate) * up for the MLP, in one launch: x `[..., 2*I]` (gate then up) -> `[..., I]`.

Computed in fp32 and rounded once to x's dtype (`F.silu(gate) * up` in bf16 rounds twice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common

_BLOCK = 1024  # output columns per program


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr, FAST: tl.constexpr):
    """One row x BLOCK output columns per program."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + cols, common.to_dtype(y, out_ptr.dtype.element_ty, FAST), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton `silu_mul_ref`; rows of x may be strided (last dimension made contiguous if it is not)."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"silu_mul needs an even last dimension (gate then up), got {width}")
    inter = width // 2
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    x2 = x2 if x2.dim() == 2 else x2.reshape(-1, width)
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if out2.numel() > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, inter, x2.stride(0), out2.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 1,
            **common.launch_options(x),
        )
    return out
