"""Norms with an optional fused residual add, each with its fused quantizing producer: one `ops` launch.

`RMSNorm` follows Hugging Face Llama (normalized in fp32, cast back to the input dtype, then scaled by the
weight); with `unit_offset` it follows Gemma (scaled by `1 + weight` in fp32, cast once). `LayerNorm` has a
weight and a bias. `feed` hands the result to the next linear layer in the form that layer asks for
(`LinearBase.input_quant(num_tokens)`).
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel import ops
from kestrel.model.layers.linear import LinearBase
from kestrel.model.layers.weights import default_weight_loader
from kestrel.quant.base import QuantAct

NormOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None,
                 unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        # Gemma stores w with the scale 1 + w, so an untrained norm is all zeros.
        init = torch.zeros if unit_offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormOutput:
        """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`."""
        return ops.rms_norm(x, self.weight, self.eps, residual, unit_offset=self.unit_offset)

    def feed(self, x: torch.Tensor, residual: torch.Tensor | None, consumer: LinearBase,
             fuse: bool = True) -> tuple[torch.Tensor | QuantAct, torch.Tensor]:
        """(the norm of `x` (+ `residual`) in the form `consumer` takes, the new residual); with no residual
        given, `x` itself is the residual."""
        spec = consumer.input_quant(x.numel() // x.shape[-1]) if fuse else None
        if spec is None:
            if residual is None:
                return self(x), x
            return self(x, residual)
        act, new_residual = ops.rms_norm_quant(x, self.weight, self.eps, spec.dtype, residual, spec.scale, spec.azp,
                                               spec.symmetric, unit_offset=self.unit_offset)
        return act, x if residual is None else new_residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", unit_offset" if self.unit_offset else "")


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype: torch.dtype | None = None,
                 bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormOutput:
        return ops.layer_norm(x, self.weight, self.bias, self.eps, residual)

    def feed(self, x: torch.Tensor, residual: torch.Tensor | None, consumer: LinearBase,
             fuse: bool = True) -> tuple[torch.Tensor | QuantAct, torch.Tensor]:
        # No fused LayerNorm->quant kernel: the consumer quantizes its own input.
        if residual is None:
            return self(x), x
        return self(x, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
