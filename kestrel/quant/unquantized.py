"""The default methods: a linear layer's weight kept in the model dtype (`ops.linear`; at decode sizes the GEMV,
`ops.gemv`, where the GPU's table lists the weight's shape), and a mixture-of-experts layer's experts kept in the
model dtype (`ops.fused_moe`)."""

from __future__ import annotations

import torch
from torch import nn

from kestrel import ops
from kestrel.kernels.gemv import GemvConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod, decode_gemv, expert_param


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
        layer.cpu_packed_weight = None

    def process_after_loading(self, layer: nn.Module) -> None:
        """On the CPU, a float32 weight is also kept in oneDNN's blocked layout (`ops.pack_linear_weight`): it costs
        the weight's size again in memory and saves oneDNN re-creating that layout on every call."""
        layer.cpu_packed_weight = ops.pack_linear_weight(layer.weight)

    @staticmethod
    def gemv_config(layer: nn.Module, x2: torch.Tensor) -> GemvConfig | None:
        """The decode GEMV's config where it runs the rows of `x2` `[M, K]` (in the weight's dtype), else None."""
        gemv = decode_gemv(layer, x2.shape[0])
        return gemv if gemv is not None and x2.dtype == layer.weight.dtype else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        gemv = self.gemv_config(layer, x2)
        if gemv is not None:
            return ops.gemv(x2, layer.weight, None, x.dtype, bias, config=gemv).reshape(*x.shape[:-1], -1)
        return ops.linear(x, layer.weight, bias, packed=getattr(layer, "cpu_packed_weight", None))


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """`w13_weight [E, 2I, H]` (each expert's gate rows, then its up rows) and `w2_weight [E, H, I]` in the model
    dtype, loaded from the checkpoint's per-expert `weight` tensors."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        E, H, inter = num_experts, hidden_size, intermediate_size
        layer.register_parameter("w13_weight", expert_param(torch.empty(E, 2 * inter, H, dtype=params_dtype),
                                                            "w13", "weight", 0))
        layer.register_parameter("w2_weight", expert_param(torch.empty(E, H, inter, dtype=params_dtype),
                                                           "w2", "weight", 1))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str) -> torch.Tensor:
        return ops.fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation)
