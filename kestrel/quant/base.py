"""QuantMethod: how one linear layer creates, prepares and applies its weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from kestrel.kernels.quant_act import QuantAct

__all__ = ["InputQuant", "QuantAct", "QuantMethod"]


@dataclass(frozen=True)
class InputQuant:
    """How one layer quantizes its input: the keyword arguments that `ops.rms_norm_quant` and
    `ops.act_mul_quant` take, so a fused producer can emit exactly what `apply_quantized` expects."""

    dtype: torch.dtype
    symmetric: bool = True
    scale: torch.Tensor | None = None  # static per-tensor scale; None = dynamic per token
    azp: torch.Tensor | None = None  # static per-tensor zero point (asymmetric INT8)


class QuantMethod(ABC):
    """One object per linear layer kind. The layer owns the parameters; the method decides them.

    `create_weights` registers parameters on `layer`; each parameter carries a `weight_loader`
    attribute `(param, loaded_weight, shard_id=None)` and, when it is split along the output
    dimension for merged layers (qkv, gate_up), an `output_dim` attribute.
    `process_after_loading` turns loaded weights into the form `apply` wants (for example,
    quantizes a bf16 weight into fp8 with per-channel scales). `apply` computes `x @ W^T + bias`.
    """

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None: ...

    def process_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def input_quant(self, layer: nn.Module) -> InputQuant | None:
        """What a fused producer (norm, activation) must emit for this layer's input, or None: the layer takes
        its input in the model dtype. The producers ask the layer, never test the method's type."""
        return None
