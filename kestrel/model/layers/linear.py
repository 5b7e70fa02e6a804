"""Linear layers whose parameters are created by a QuantMethod and loaded by the layer's own loader.

Loading contract (what a QuantMethod may rely on):
- `create_weights(layer, input_size, output_partition_sizes, params_dtype)` registers parameters on the
  layer, sized for this rank (`input_size` and the output sizes are this rank's share), and tags them for the
  loader: `output_dim`, `input_dim`, `packed_dim` + `packed_factor`, `group_size`, `per_shard`,
  `checkpoint_optional` (each explained in `kestrel.model.layers.weights`).
- Each parameter's `weight_loader(param, loaded_weight, shard_id=None)` copies a checkpoint tensor in.
  A method can point it at `layer.weight_loader` (the sharding-aware default below) or at its own
  function; parameters left without one get `layer.weight_loader`.
- After all tensors are loaded the model calls `layer.process_after_loading()`, which hands the layer
  to `quant_method.process_after_loading` (e.g. to quantize the loaded weight).

Tensor parallelism: a column layer splits its outputs across `tp_size` ranks, a row layer its inputs.
The loaders take this rank's slice of each checkpoint tensor; a row layer's output is the sum of the ranks'
partial outputs, over the `ParallelContext` it was built with. How that sum is formed is the method's
(`QuantMethod.apply_row_parallel` and the other `*_row_parallel` hooks): a plain method all-reduces its
partial products, a W8A8 method first reduces the quantization scales over the group so that every rank
quantizes exactly as one device would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from kestrel.distributed.parallel import ParallelContext, single_process
from kestrel.model.layers.weights import WeightShapeError, copy_checked, features_per_element, stored_span
from kestrel.quant.base import InputQuant, QuantAct, QuantMethod
from kestrel.quant.unquantized import UnquantizedLinearMethod

ShardId = str | int
TPSplit = Literal["output", "input"] | None


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """`y = x W^T + b` with `W` made of `len(output_sizes)` merged shards named by `shard_ids`."""

    tp_split: TPSplit = None

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool = False,
        quant_method: QuantMethod | None = None,
        params_dtype: torch.dtype | None = None,
        shard_ids: Sequence[ShardId] = (),
        tp_size: int = 1,
        tp_rank: int = 0,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        if parallel is not None:
            tp_size, tp_rank = parallel.tp_size, parallel.tp_rank
        else:
            parallel = single_process()
        self.parallel = parallel
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"invalid tensor-parallel rank {tp_rank} of size {tp_size}")
        if shard_ids and len(shard_ids) != len(output_sizes):
            raise ValueError(f"{len(shard_ids)} shard ids for {len(output_sizes)} output shards")
        params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.input_size = input_size
        self.output_size = sum(output_sizes)
        self.shard_ids: list[ShardId] = list(shard_ids)
        if self.tp_split == "output":
            self.output_partition_sizes = [_divide(s, tp_size, "output size") for s in output_sizes]
            self.input_size_per_partition = input_size
        elif self.tp_split == "input":
            self.output_partition_sizes = list(output_sizes)
            self.input_size_per_partition = _divide(input_size, tp_size, "input size")
        else:
            self.output_partition_sizes = list(output_sizes)
            self.input_size_per_partition = input_size
        self.out_dtype = params_dtype  # what forward returns, also from pre-quantized input
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.processed = False  # process_after_loading has run (see process_linear_layer)
        self.quant_method.create_weights(
            self, self.input_size_per_partition, list(self.output_partition_sizes), params_dtype
        )
        if bias:
            b = nn.Parameter(torch.empty(sum(self.output_partition_sizes), dtype=params_dtype), requires_grad=False)
            b.output_dim = 0
            self.register_parameter("bias", b)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader

    def shard_index(self, shard_id: ShardId) -> int:
        try:
            return self.shard_ids.index(shard_id)
        except ValueError:
            raise ValueError(f"unknown shard id {shard_id!r}; this layer's shards are {self.shard_ids}") from None

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        """(offset, size) of a merged shard along the output dim of this rank's weight."""
        index = self.shard_index(shard_id)
        return sum(self.output_partition_sizes[:index]), self.output_partition_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
        target = param.data
        detail = ""
        if shard_id is not None:
            detail = f"shard {shard_id!r}"
            if getattr(param, "per_shard", False):
                target = target[self.shard_index(shard_id)]
            else:
                output_dim = getattr(param, "output_dim", None)
                if output_dim is None:
                    raise ValueError(f"cannot load shard {shard_id!r} into a parameter without output_dim")
                offset, size = stored_span(param, output_dim, *self.shard_range(shard_id))
                target = target.narrow(output_dim, offset, size)
        elif len(self.shard_ids) > 1 and (getattr(param, "per_shard", False)
                                          or getattr(param, "output_dim", None) is not None):
            # A checkpoint that stores the merged tensor itself (Phi-3's qkv_proj and gate_up_proj): each part
            # loads as its shard would, so sharding and per-part layouts stay the shards' business. A per-shard
            # parameter takes its entries (one value for all shards when the checkpoint has one).
            for part_id, part in zip(self.shard_ids, self._split_merged(param, loaded_weight), strict=True):
                self.weight_loader(param, part, part_id)
            return
        copy_checked(target, self._rank_slice(param, loaded_weight, shard_id), detail)

    def checkpoint_output_sizes(self) -> list[int]:
        """Each merged shard's output size in the (unsharded) checkpoint."""
        return [size * (self.tp_size if self.tp_split == "output" else 1) for size in self.output_partition_sizes]

    def _split_merged(self, param: nn.Parameter, loaded: torch.Tensor) -> list[torch.Tensor]:
        if getattr(param, "per_shard", False):
            return [loaded.reshape(-1)[min(i, loaded.numel() - 1)] for i in range(len(self.shard_ids))]
        dim = param.output_dim
        factor = features_per_element(param, dim)
        sizes = self.checkpoint_output_sizes()
        if loaded.shape[dim] * factor != sum(sizes) or any(size % factor for size in sizes):
            raise WeightShapeError(tuple(loaded.shape), tuple(param.shape), "a merged checkpoint tensor")
        return list(loaded.split([size // factor for size in sizes], dim=dim))

    def _rank_slice(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None) -> torch.Tensor:
        if self.tp_size == 1 or self.tp_split is None:
            return loaded
        dim = getattr(param, "output_dim" if self.tp_split == "output" else "input_dim", None)
        if dim is None:
            return loaded
        size, cut = divmod(loaded.shape[dim], self.tp_size)
        factor = features_per_element(param, dim)
        if cut and factor > 1:
            raise ValueError(f"cannot split a checkpoint tensor of shape {tuple(loaded.shape)} along dim {dim} over "
                             f"tp_size={self.tp_size}: a rank's slice would cut a packed element or a group of "
                             f"{factor} features")
        return loaded.narrow(dim, self.tp_rank * size, size)

    def process_after_loading(self) -> None:
        self.quant_method.process_after_loading(self)

    def rank_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (its own slice for a column layer)."""
        return self.bias

    def input_quant(self, num_tokens: int | None = None) -> InputQuant | None:
        """What a fused producer (norm, activation) must emit for this layer, or None: model-dtype input.
        `num_tokens`: the rows the producer emits (the method's choice may depend on it)."""
        return self.quant_method.input_quant(self, num_tokens)

    def forward(self, x: torch.Tensor | QuantAct) -> torch.Tensor:
        """`x` in the model dtype, or already quantized by a fused producer as `input_quant()` asked."""
        if isinstance(x, QuantAct):
            return self.apply_quantized(x, self.out_dtype)
        return self.quant_method.apply(self, x, self.bias)

    def apply_quantized(self, act: QuantAct, out_dtype: torch.dtype) -> torch.Tensor:
        """The output from activations a fused producer already quantized (as `input_quant()` asked)."""
        return self.quant_method.apply_quantized(self, act, out_dtype, self.rank_bias())

    def apply_gated(self, x: torch.Tensor | QuantAct, activation: str) -> torch.Tensor | None:
        """For a gate/up layer: `act(gate) * up` of its output from one GEMM launch, or None where its method has
        none for this input (`QuantMethod.apply_gated`)."""
        return self.quant_method.apply_gated(self, x, activation, self.rank_bias())

    def quantize_input(self, x: torch.Tensor) -> QuantAct:
        return self.quant_method.quantize_input(self, x)

    @property
    def needs_global_input_scale(self) -> bool:
        """True when a fused producer's per-token scales would see only this rank's slice of the input."""
        return False

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, shards={self.shard_ids or None}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
                f"method={type(self.quant_method).__name__}")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(self, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(input_size, [output_size], **kwargs)


class ColumnLinear(LinearBase):
    """Output features split across ranks; the output stays split (the next row layer consumes it)."""

    tp_split: TPSplit = "output"

    def __init__(self, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(input_size, [output_size], **kwargs)


class MergedColumnLinear(LinearBase):
    """Several column layers on the same input in one GEMM (gate and up: shard ids 0 and 1)."""

    tp_split: TPSplit = "output"

    def __init__(self, input_size: int, output_sizes: Sequence[int], **kwargs) -> None:
        super().__init__(input_size, output_sizes, shard_ids=range(len(output_sizes)), **kwargs)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one GEMM (shard ids "q", "k", "v"); GQA has fewer k/v heads."""

    tp_split: TPSplit = "output"

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 interleaved_rotary_dim: int = 0, **kwargs) -> None:
        """`interleaved_rotary_dim`: the checkpoint's q and k rotate pairs (2i, 2i+1) of each head's first that many
        features (GLM, Command R); their rows are loaded in the halves order the rotary kernel rotates instead
        (the same order for q and k leaves every q.k unchanged)."""
        parallel = kwargs.get("parallel")
        tp_size = parallel.tp_size if parallel is not None else kwargs.get("tp_size", 1)
        tp_rank = parallel.tp_rank if parallel is not None else kwargs.get("tp_rank", 0)
        if num_heads % tp_size or (num_kv_heads % tp_size and tp_size % num_kv_heads):
            raise ValueError(f"tp_size={tp_size} must divide num_heads={num_heads} and divide or be a multiple "
                             f"of num_kv_heads={num_kv_heads}")
        self.head_size = head_size
        self.interleaved_rotary_dim = interleaved_rotary_dim
        self.total_heads = (num_heads, num_kv_heads)
        self.num_heads = num_heads // tp_size
        # With more ranks than kv heads each kv head is replicated on tp_size / num_kv_heads ranks.
        self.num_kv_heads = max(num_kv_heads // tp_size, 1)
        self.kv_head_start = (tp_rank * self.num_kv_heads if num_kv_heads >= tp_size
                              else tp_rank // (tp_size // num_kv_heads))
        # Sizes per rank times tp_size: the base class divides them back.
        kv = self.num_kv_heads * head_size * tp_size
        super().__init__(hidden_size, [num_heads * head_size, kv, kv], shard_ids=("q", "k", "v"), **kwargs)

    def checkpoint_output_sizes(self) -> list[int]:
        heads, kv_heads = self.total_heads
        return [heads * self.head_size, kv_heads * self.head_size, kv_heads * self.head_size]

    def _deinterleave(self, param: nn.Parameter, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        if features_per_element(param, dim) != 1:
            raise ValueError("interleaved RoPE needs q/k rows one per element; this checkpoint packs them")
        rotary = self.interleaved_rotary_dim
        heads = loaded.shape[dim] // self.head_size
        order = torch.arange(loaded.shape[dim]).view(heads, self.head_size)
        order[:, :rotary] = torch.cat((order[:, 0:rotary:2], order[:, 1:rotary:2]), dim=1)
        return loaded.index_select(dim, order.flatten().to(loaded.device))

    def _rank_slice(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None) -> torch.Tensor:
        dim = getattr(param, "output_dim", None)
        if (self.interleaved_rotary_dim and shard_id in ("q", "k") and dim is not None
                and not getattr(param, "per_shard", False)):
            loaded = self._deinterleave(param, loaded, dim)
        if shard_id in ("k", "v") and self.tp_size > 1 and dim is not None and not getattr(param, "per_shard", False):
            offset, size = stored_span(param, dim, self.kv_head_start * self.head_size,
                                       self.num_kv_heads * self.head_size)
            return loaded.narrow(dim, offset, size)
        return super()._rank_slice(param, loaded, shard_id)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split(self.output_partition_sizes, dim=-1)


class RowLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed across ranks."""

    tp_split: TPSplit = "input"

    def __init__(self, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(input_size, [output_size], **kwargs)

    def rank_bias(self) -> torch.Tensor | None:
        # With TP only rank 0 adds the bias, so the sum over ranks adds it once.
        return self.bias if self.tp_rank == 0 else None

    def input_quant(self, num_tokens: int | None = None) -> InputQuant | None:
        # A producer sees only this rank's slice of the row, not the per-token scale over all of it.
        return None if self.needs_global_input_scale else super().input_quant(num_tokens)

    def forward(self, x: torch.Tensor | QuantAct) -> torch.Tensor:
        if isinstance(x, QuantAct):
            return self.apply_quantized(x, self.out_dtype)
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        return self.quant_method.apply_row_parallel(self, x, self.rank_bias(), self.parallel)

    @property
    def needs_global_input_scale(self) -> bool:
        return self.tp_size > 1 and self.quant_method.needs_global_input_scale(self)

    def quantize_input(self, x: torch.Tensor) -> QuantAct:
        """`x [M, K/tp]` quantized as the method would quantize the whole row (per-token scales over all ranks)."""
        if self.tp_size == 1:
            return self.quant_method.quantize_input(self, x)
        return self.quant_method.quantize_input_row_parallel(self, x, self.parallel)

    def apply_quantized(self, act: QuantAct, out_dtype: torch.dtype) -> torch.Tensor:
        if self.tp_size == 1:
            return super().apply_quantized(act, out_dtype)
        return self.quant_method.apply_quantized_row_parallel(self, act, out_dtype, self.rank_bias(), self.parallel)

    def process_after_loading(self) -> None:
        if self.tp_size == 1:
            super().process_after_loading()
        else:
            self.quant_method.process_after_loading_row_parallel(self, self.parallel)


def process_linear_layer(layer: nn.Module) -> None:
    """The layer's post-loading hook, once (a linear layer, or any layer with a `processed` flag and
    `process_after_loading()`: fused experts): the dummy loader runs it as soon as a deferred layer is filled, and
    the model's pass over every layer then leaves that one alone."""
    if not layer.processed:
        layer.process_after_loading()
        layer.processed = True


def process_linear_layers_after_loading(model: nn.Module) -> None:
    """Give every linear layer's quant method its post-loading hook (quantize, transpose, ...), and every other
    layer that holds a method the same way (a `processed` flag and `process_after_loading()`: fused experts)."""
    for module in model.modules():
        if hasattr(module, "processed") and hasattr(module, "process_after_loading"):  # linear layers among them
            process_linear_layer(module)
