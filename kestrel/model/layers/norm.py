"""RMSNorm with an optional fused residual add, numerically matching Hugging Face Llama: one `ops.rms_norm`."""

from __future__ import annotations

import torch
from torch import nn

from kestrel import ops
from kestrel.model.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`. HF numerics: normalized in
        fp32, cast back to the input dtype, then scaled by the weight."""
        return ops.rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
