"""RMSNorm (with the residual add) and SiLU-and-multiply on the CPU in one pass each (`elementwise.c`, built by
`native.py`), for float32 rows; anything else, or no C compiler, takes the PyTorch references
(`kernels/norm.py`, `kernels/activation.py`), which stay the tests' oracle."""

from __future__ import annotations

import torch

from kestrel.kernels.activation import act_mul_ref
from kestrel.kernels.cpu import native
from kestrel.kernels.norm import rms_norm_ref


def _rows_of(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.is_contiguous()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 unit_offset: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_ref`'s result: `norm(x)`, or with a residual `(norm(x + residual), x + residual)`."""
    fn = native.rms_norm_fn()
    if (fn is None or not _rows_of(x) or x.shape[-1] == 0 or not _rows_of(weight)
            or weight.shape != (x.shape[-1],) or (residual is not None and (
                not _rows_of(residual) or residual.shape != x.shape))
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return rms_norm_ref(x, weight, eps, residual, unit_offset)
    dim = x.shape[-1]
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    status = fn(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                out.data_ptr(), residual_out.data_ptr() if residual_out is not None else None, x.numel() // dim, dim,
                eps, int(unit_offset), torch.get_num_threads())
    if status != 0:
        return rms_norm_ref(x, weight, eps, residual, unit_offset)
    return out if residual_out is None else (out, residual_out)


def act_mul_cpu(x: torch.Tensor, activation: str) -> torch.Tensor:
    """`act_mul_ref(x, activation)`: SiLU rows in C, other activations through the reference."""
    fn = native.silu_mul_fn() if activation == "silu" else None
    if (fn is None or not _rows_of(x) or x.shape[-1] % 2 or x.shape[-1] == 0
            or (torch.is_grad_enabled() and x.requires_grad)):
        return act_mul_ref(x, activation)
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    if fn(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter, torch.get_num_threads()) != 0:
        return act_mul_ref(x, activation)
    return out
