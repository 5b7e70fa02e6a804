"""INT8 W8A8 linear: symmetric per-channel weights, per-token (or static per-tensor) activations, symmetric
or asymmetric; the zero-point correction `azp * azp_adj` runs in the GEMM's epilogue."""

from __future__ import annotations

import torch

from kestrel import ops
from kestrel.kernels.quant_types import QuantAct
from kestrel.quant.w8a8 import W8A8LinearMethod, absmax_scales, scaled_copy

INT8_SYM_MAX = 127


class Int8LinearMethod(W8A8LinearMethod):
    """`quantization="int8"`: weights in [-127, 127]; activations symmetric, or with a per-token zero
    point when `symmetric_activations=False` (worth it for inputs with an offset, e.g. after SiLU)."""

    quant_dtype = torch.int8
    method_name = "int8"

    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_weight_int8(weight)

    def quantize_dynamic(self, x: torch.Tensor) -> QuantAct:
        return ops.quant_int8_per_token(x, self.symmetric)


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [N, K]` -> (int8 `[N, K]` in [-127, 127], fp32 `[N, 1]` = absmax / 127), nearest-even rounding."""
    scale = absmax_scales(weight, INT8_SYM_MAX)
    q = scaled_copy(weight, scale).round_().clamp_(-INT8_SYM_MAX, INT8_SYM_MAX).to(torch.int8)
    return q, scale
