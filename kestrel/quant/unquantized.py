"""The default linear method: weights kept in the model dtype, `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.quant.base import QuantMethod


class UnquantizedLinearMethod(QuantMethod):
    """`weight [sum(output_partition_sizes), input_size]`, loaded slice by slice by the layer's loader."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype),
                              requires_grad=False)
        # The layer knows where each merged shard lives; the parameter only says along which dims.
        weight.output_dim = 0
        weight.input_dim = 1
        weight.weight_loader = layer.weight_loader
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
