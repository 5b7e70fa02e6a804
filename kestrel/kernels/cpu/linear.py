"""Dense float32 linear layers on the CPU through oneDNN (`torch.ops.mkldnn._linear_pointwise`, the op inductor's
CPU backend emits), in place of `F.linear`'s MKL sgemm: on the development machine's AMD EPYC (AVX-512) it ran
kestrel-tiny's shapes 1.3-2.5x faster (M = 64 and 1600 rows, K = 256 / 640), with the dense weight as it is: no
packed copy, no extra memory. Sums are reordered, so results differ from `F.linear` by float32 rounding.
Anything else (other dtypes, autograd, a torch without oneDNN) takes `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for CPU tensors."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or (bias is not None and bias.dtype != x.dtype)
            or weight.dim() != 2 or not weight.is_contiguous() or x.numel() == 0 or not onednn_available()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
