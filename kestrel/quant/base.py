"""QuantMethod: how one linear layer creates, prepares and applies its weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kestrel.kernels.quant_types import QuantAct

__all__ = ["InputQuant", "QuantAct", "QuantMethod"]


@dataclass(frozen=True)
class InputQuant:
    """How one layer quantizes its input: the keyword arguments that `ops.rms_norm_quant` and
    `ops.act_mul_quant` take, so a fused producer can emit exactly what `apply_quantized` expects."""

    dtype: torch.dtype
    symmetric: bool = True
    scale: torch.Tensor | None = None  # static per-tensor scale; None = dynamic per token
    azp: torch.Tensor | None = None  # static per-tensor zero point (asymmetric INT8)


class TensorParallelGroup(Protocol):
    """The collectives a row-parallel layer's method may use (a `ParallelContext` is one): in place, over the
    ranks that each hold a slice of the layer's input features."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor: ...


class QuantMethod(ABC):
    """One object per linear layer. The layer owns the parameters; the method decides them.

    `create_weights` registers parameters on `layer`, each tagged for the layer's loader (the tags are listed in
    `kestrel.model.layers.weights`: `output_dim`, `input_dim`, `packed_dim` / `packed_factor`, `group_size`,
    `per_shard`, `checkpoint_optional`, and an optional own `weight_loader`). `process_after_loading` turns
    loaded weights into the form `apply` wants (for example, quantizes a bf16 weight into fp8 with per-channel
    scales). `apply` computes `x @ W^T + bias`.

    Methods that quantize the layer's input say how in `input_quant`, so that the op before the layer (a norm,
    an activation) can emit the quantized input itself (`apply_quantized` then takes it). A row-parallel layer
    (input features split across the tensor-parallel group) goes through the `*_row_parallel` hooks; their
    defaults suit a method whose result on a slice of the input is a partial sum (the unquantized one).
    """

    # Set by the plan for random weights (load_format="dummy"): a method that quantizes at load creates its
    # high-precision weight on the meta device, for a loader that fills and quantizes one layer at a time.
    # Methods that do not quantize at load ignore it.
    defer_weight: bool = False

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

    def planned_weight_bytes(self, weight: nn.Parameter) -> tuple[int, int] | None:
        """(bytes while loading, bytes once processed) of the layer's `weight` with what `process_after_loading`
        adds beside it, for a method that changes them (one that quantizes at load); None: the parameters stay
        as created. The memory plan reads it from the model built on the meta device."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    # ----------------------------------------------------------------------------------- quantized input

    def input_quant(self, layer: nn.Module) -> InputQuant | None:
        """What a fused producer (norm, activation) must emit for this layer's input, or None: the layer takes
        its input in the model dtype. The producers ask the layer, never test the method's type."""
        return None

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> QuantAct:
        """`x [M, K]` quantized as `input_quant` says (the unfused producer)."""
        raise TypeError(f"{type(self).__name__} takes its input in the model dtype (input_quant() is None)")

    def apply_quantized(self, layer: nn.Module, act: QuantAct, out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """`[M, N]` in `out_dtype` from an input already quantized as `input_quant` says."""
        raise TypeError(f"{type(self).__name__} takes its input in the model dtype (input_quant() is None)")

    # ----------------------------------------------------------------------------------- row parallel

    def needs_global_input_scale(self, layer: nn.Module) -> bool:
        """True when the input's quantization depends on whole input rows (per-token scales): a row-parallel
        rank, which holds a slice of each row, must then reduce over the group before quantizing, and a fused
        producer (which sees the slice only) cannot quantize for it."""
        return False

    def process_after_loading_row_parallel(self, layer: nn.Module, group: TensorParallelGroup) -> None:
        """`process_after_loading` for a layer holding a slice of the input features: a method whose weight
        preparation depends on whole weight rows (per-channel absmax at load) reduces over `group` here."""
        self.process_after_loading(layer)

    def apply_row_parallel(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                           group: TensorParallelGroup) -> torch.Tensor:
        """The full output from this rank's slice `x` of the input features: the partial products summed over
        `group` (`bias` is given to one rank only)."""
        return group.all_reduce(self.apply(layer, x, bias))

    def quantize_input_row_parallel(self, layer: nn.Module, x: torch.Tensor, group: TensorParallelGroup) -> QuantAct:
        """This rank's slice `x` of the input quantized as the whole row would be."""
        return self.quantize_input(layer, x)

    def apply_quantized_row_parallel(self, layer: nn.Module, act: QuantAct, out_dtype: torch.dtype,
                                     bias: torch.Tensor | None, group: TensorParallelGroup) -> torch.Tensor:
        """The full output from this rank's slice of an already quantized input, summed over `group`."""
        return group.all_reduce(self.apply_quantized(layer, act, out_dtype, bias))
