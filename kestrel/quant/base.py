"""QuantMethod: how one linear layer creates, prepares and applies its weights; FusedMoEMethod: the same for a
mixture-of-experts layer's experts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from kestrel.kernels import gemv as _gemv
from kestrel.kernels.quant_types import QuantAct

__all__ = ["FusedMoEMethod", "InputQuant", "QuantAct", "QuantMethod", "decode_gemv", "expert_param"]


@dataclass(frozen=True)
class InputQuant:
    """How one layer quantizes its input: the keyword arguments that `ops.rms_norm_quant` and
    `ops.act_mul_quant` take, so a fused producer can emit exactly what `apply_quantized` expects."""

    dtype: torch.dtype
    symmetric: bool = True
    scale: torch.Tensor | None = None  # static per-tensor scale; None = dynamic per token
    azp: torch.Tensor | None = None  # static per-tensor zero point (asymmetric INT8)


def decode_gemv(layer: nn.Module, num_tokens: int | None) -> _gemv.GemvConfig | None:
    """The decode GEMV's config (`kernels/gemv.py`) when it runs `num_tokens` rows of this layer's 2-D weight,
    or None: the layer's GEMM. The GPU table is looked up once per layer (host work every eager step would
    repeat), after the weight has its final dtype and shape."""
    if num_tokens is None:
        return None
    if "decode_gemv_config" not in layer.__dict__:
        weight = layer.weight
        if _gemv.weight_kind(weight.dtype) is None or weight.dim() != 2 or weight.device.type == "meta":
            return None  # not processed yet, or nothing the GEMV reads: nothing to look up
        layer.decode_gemv_config = _gemv.table_config(weight)
    cfg = layer.decode_gemv_config
    return cfg if _gemv.takes_rows(cfg, num_tokens) else None


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

    def input_quant(self, layer: nn.Module, num_tokens: int | None = None) -> InputQuant | None:
        """What a fused producer (norm, activation) must emit for this layer's input, or None: the layer takes
        its input in the model dtype. The producers ask the layer, never test the method's type. `num_tokens`:
        the rows the producer is about to emit (a method may take model-dtype input at some sizes only); None
        asks about no size in particular."""
        return None

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> QuantAct:
        """`x [M, K]` quantized as `input_quant` says (the unfused producer)."""
        raise TypeError(f"{type(self).__name__} takes its input in the model dtype (input_quant() is None)")

    def apply_quantized(self, layer: nn.Module, act: QuantAct, out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """`[M, N]` in `out_dtype` from an input already quantized as `input_quant` says."""
        raise TypeError(f"{type(self).__name__} takes its input in the model dtype (input_quant() is None)")

    def apply_gated(self, layer: nn.Module, x: torch.Tensor | QuantAct, activation: str,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """For a gate/up layer (gate rows, then up rows): `act(gate) * up` of its output `[M, N/2]` in the model
        dtype from one GEMM whose epilogue applies the activation, or None where this method has no such GEMM for
        this input (the caller then runs the layer and the activation apart). `x` as `forward` takes it."""
        return None

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


# ------------------------------------------------------------------------------------------- experts

ExpertProj = Literal["w13", "w2"]


def expert_param(data: torch.Tensor, proj: ExpertProj, suffix: str, intermediate_dim: int | None, *,
                 block: int = 1, per_tensor: bool = False) -> nn.Parameter:
    """A parameter of a fused-experts layer, `[E_rank, ...]` (one slice per expert of this rank), tagged for the
    layer's loader, which reads every expert's checkpoint tensor `{layer prefix}.{e}.{module}.{suffix}`:
    - `proj`: "w13" fills each expert's slice from its gate module then its up module, stacked along
      `intermediate_dim`; "w2" from its down module.
    - `suffix`: the tensor's name under the module ("weight", "weight_scale", "weight_scale_inv", ...).
    - `intermediate_dim`: the dim of one expert's slice that runs along the intermediate features (split over
      tensor-parallel ranks), or None for a tensor without one (a down projection's per-channel scale).
    - `block`: intermediate features per stored element along that dim (block scales); a rank's share must hold
      whole blocks.
    - `per_tensor`: the checkpoint stores one value per module; it fills the module's part of the slice (a
      per-tensor weight scale expanded to the per-channel scale the kernel applies: exact)."""
    param = nn.Parameter(data, requires_grad=False)
    param.expert_proj = proj
    param.checkpoint_suffix = suffix
    param.intermediate_dim = intermediate_dim
    param.intermediate_block = block
    param.per_tensor = per_tensor
    return param


class FusedMoEMethod(ABC):
    """One object per mixture-of-experts layer (`kestrel.model.layers.moe.FusedExperts`): how its experts' stacked
    weights are created, prepared after loading and run. The layer owns and loads the parameters; the method
    decides them, as a `QuantMethod` does for a linear layer.

    `create_weights` registers this rank's parameters on `layer`, each made by `expert_param` (the layer derives
    every expert's checkpoint names and its tensor-parallel slice from the tags). `process_after_loading` turns
    them into what `apply` wants (quantizes a high-precision weight, checks scales). `apply` runs the experts:
    `x [T, H]`, each token's `topk_weights [T, k]` (float32) and `topk_ids [T, k]` (this rank's expert ids, -1 for
    another rank's expert) -> this rank's partial output `[T, H]`, summed over the group by the layer.

    What the layer offers the method: `layer.intermediate_group`, the tensor-parallel group over which each
    expert's intermediate dimension is split (None when this rank holds whole experts), for a method whose
    quantization needs whole intermediate rows (per-channel scales of the down projection, per-token scales of
    the intermediate); `layer.prefix`, the layer's checkpoint name, for messages.
    """

    # Set by the plan for random weights (load_format="dummy"): a method that quantizes the experts at load creates
    # their high-precision weights on the meta device, for the dummy loader to create, fill and process one layer
    # at a time; the others create their weights where the model is built.
    defer_weight: bool = False

    def planned_weight_bytes(self, weight: nn.Parameter) -> tuple[int, int] | None:
        """As `QuantMethod.planned_weight_bytes`, for each of the layer's stacked expert weights (`w13_weight`,
        `w2_weight`)."""
        return None

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        """Register `num_experts` experts of `hidden_size` and this rank's `intermediate_size` (each expert's
        intermediate dimension divided by the tensor-parallel size, or whole under expert parallelism)."""

    def process_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str) -> torch.Tensor: ...
