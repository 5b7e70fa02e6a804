"""FP8 (e4m3) W8A8 linear: per-channel weight scales, per-token (or static per-tensor) activation scales."""

from __future__ import annotations

import torch

from kestrel import ops
from kestrel.kernels.quant_act import FP8_MAX
from kestrel.kernels.quant_types import QuantAct
from kestrel.quant.w8a8 import W8A8LinearMethod, absmax_scales, scaled_copy


class Fp8LinearMethod(W8A8LinearMethod):
    """`quantization="fp8"`: weights and activations in float8_e4m3fn, symmetric, max 448."""

    quant_dtype = torch.float8_e4m3fn
    method_name = "fp8"

    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_weight_fp8(weight)

    def quantize_dynamic(self, x: torch.Tensor) -> QuantAct:
        return ops.quant_fp8_per_token(x)


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [N, K]` -> (float8_e4m3fn `[N, K]`, fp32 `[N, 1]` = absmax / 448), nearest-even rounding."""
    scale = absmax_scales(weight, FP8_MAX)
    q = scaled_copy(weight, scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
