"""FP8 weights with model-dtype activations (W8A16-FP8): dense linear layers of block-FP8 checkpoints (vLLM's `fp8`
format with `weight_block_size`, DeepSeek-V3 and the Qwen3 FP8 releases; compressed-tensors `FP8_BLOCK`) and of
compressed-tensors FP8 weight-only checkpoints, run on the weight-only kernel (`ops.wna16_gemm`, weight type
`fp8_e4m3`).

The checkpoint's `weight` (float8_e4m3fn `[N, K]`) loads as stored; its scales (`Fp8WeightSpec.scale_name`) are one
value per block of `rows x cols` weights:
- block `[bn, bk]`: `[ceil(N / bn), ceil(K / bk)]` (the last block of a row or column may be partial);
- group: `[N, K / g]`; channel: `[N, 1]`; tensor: one value per checkpoint module.

Every scale of a block is the same for the block's `bn` rows, so the loader repeats each scale row over its rows as
it reads a module's tensor: the parameter holds one scale row per output feature (`[N, ceil(K / bk)]`), and merged
layers (q/k/v, gate/up) and column-parallel slices are then plain row ranges, each part keeping its own blocks.
Along K a block scale is a group scale of group `bk`; when K is no multiple of `bk` (a partial last block) the kernel
runs groups of gcd(K, bk), each scale repeated over the groups of its block. Either way the packed weight represents
the checkpoint exactly.

By default kestrel departs from vLLM here: vLLM quantizes the activations per token and `bk` columns and runs a W8A8
block GEMM; kestrel keeps them in the model dtype (at least as accurate). `fp8_block_activations="fp8"` runs the
block layers of checkpoints that ask for quantized inputs as they say: `Fp8BlockLinearMethod` keeps the FP8 weight
and its per-row block scales as loaded, quantizes each input per token and `bk` features and runs the W8A8 block
GEMM (`ops.block_fp8_mm`).

Tensor parallelism: a column layer splits the rows (any split: rows carry their own scales); a row layer splits K,
and each rank's share of the input features must hold whole `bk` blocks (whole groups), else a ConfigError naming
the layer and the tensor-parallel size. The partial products are summed (the default row-parallel hooks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError
from kestrel.quant.base import QuantMethod
from kestrel.quant.wna16 import GROUP_MULTIPLE, compact_dtype

FP8 = torch.float8_e4m3fn
Strategy = Literal["block", "group", "channel", "tensor"]
STRATEGIES: tuple[str, ...] = ("block", "group", "channel", "tensor")


@dataclass(frozen=True)
class Fp8WeightSpec:
    """How a layer's FP8 weight scales are stored. `block` is (bn, bk) for "block", (1, g) for "group"."""

    strategy: Strategy
    scale_name: str  # "weight_scale_inv" (vLLM's fp8 format) or "weight_scale" (compressed-tensors)
    block: tuple[int, int] | None = None
    # The checkpoint quantizes the inputs dynamically (per token and bk columns: block-FP8 W8A8): the dense layers
    # here keep them in the model dtype, and the experts' fused kernel quantizes them as the checkpoint says.
    quantized_inputs: bool = False
    # For messages: where the settings come from, and the setting that names the block (or group) size.
    source: str = field(default="", compare=False)
    block_field: str = field(default="weight_block_size", compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown FP8 weight strategy {self.strategy!r}; expected one of {list(STRATEGIES)}")
        if (self.block is not None) != (self.strategy in ("block", "group")):
            raise ValueError(f"FP8 weights of strategy {self.strategy!r}: block={self.block!r}")

    @property
    def cols_per_scale(self) -> int | None:
        """Input features per scale column; None: one column for the whole row."""
        return None if self.block is None else self.block[1]

    @property
    def setting(self) -> str:
        """`block_field=value` as the config writes it, for messages."""
        value = list(self.block) if self.strategy == "block" else self.cols_per_scale
        return f"{self.block_field}={value}"

    @property
    def name(self) -> str:
        return "w8a16-fp8"


class Fp8WeightOnlyLinearMethod(QuantMethod):
    """A linear layer of FP8 weights from a checkpoint, run weight-only; `layer_name` is for messages."""

    runs_as = "FP8 weights run weight-only"  # how the layer runs, for messages

    def __init__(self, spec: Fp8WeightSpec, layer_name: str) -> None:
        self.spec = spec
        self.layer_name = layer_name
        self.model_dtype = torch.float32

    # ---------------------------------------------------------------------------------------- loading

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        spec, K, N = self.spec, input_size, sum(output_partition_sizes)
        self._kernel_group(layer, K)  # the shape checks, before anything is read
        self.model_dtype = params_dtype
        weight = nn.Parameter(torch.empty(N, K, dtype=FP8), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        weight.weight_loader = self._fp8_loader(layer)
        layer.register_parameter("weight", weight)
        cols = spec.cols_per_scale
        scale = nn.Parameter(torch.empty(N, 1 if cols is None else math.ceil(K / cols), dtype=torch.float32),
                             requires_grad=False)
        scale.output_dim = 0
        if cols is not None:
            scale.input_dim, scale.group_size = 1, cols
        scale.weight_loader = self._scale_loader(layer)
        layer.register_parameter(spec.scale_name, scale)

    def _kernel_group(self, layer: nn.Module, K: int) -> int:
        """The kernel's group size for this rank's K input features (K per channel), or a ConfigError naming the
        layer when the block size, K or the tensor-parallel size do not fit the kernel."""
        spec, cols = self.spec, self.spec.cols_per_scale
        where = self._where()
        if cols is None:
            if K % GROUP_MULTIPLE:
                raise ConfigError(f"invalid shape for {where}: its {K} input features must be a multiple of "
                                  f"{GROUP_MULTIPLE} (the weight-only kernel's K step)")
            return K
        if cols % GROUP_MULTIPLE:
            raise ConfigError(f"invalid {spec.setting} for {where}: the block's {cols} input "
                              f"features must be a multiple of {GROUP_MULTIPLE} (the weight-only kernel's K step)")
        self._check_rank_blocks(layer, K)
        group = math.gcd(K, cols)
        if group % GROUP_MULTIPLE:
            raise ConfigError(f"invalid shape for {where}: its {K} input features end in a partial block of "
                              f"{K % cols}, and the weight-only kernel needs groups of a multiple of "
                              f"{GROUP_MULTIPLE} features ({spec.setting})")
        return group

    def _where(self) -> str:
        return f"layer {self.layer_name!r} ({self.spec.source}, {self.runs_as})"

    def _check_rank_blocks(self, layer: nn.Module, K: int) -> None:
        """A row-parallel layer's K input features on this rank must be whole blocks, else a ConfigError."""
        spec, tp = self.spec, getattr(layer, "tp_size", 1)
        if getattr(layer, "tp_split", None) == "input" and tp > 1 and K % spec.cols_per_scale:
            raise ConfigError(f"invalid tensor_parallel_size={tp} for {self._where()}: each rank's {K} input features "
                              f"of this row-parallel layer must be whole blocks of {spec.cols_per_scale} "
                              f"({spec.setting}); use a smaller tensor_parallel_size")

    def _fp8_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if loaded.dtype != FP8:
                raise ValueError(f"{self.layer_name}.weight: {loaded.dtype} in the checkpoint, and its "
                                 f"quantization_config ({self.spec.source}) says float8_e4m3fn")
            layer.weight_loader(param, loaded, shard_id)

        return load

    def _scale_loader(self, layer: nn.Module):
        """Each checkpoint scale row repeated over the output rows of its block, then placed and sliced as a
        per-row tensor by the layer's loader."""
        spec = self.spec

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            sizes = layer.checkpoint_output_sizes()
            rows = sum(sizes) if shard_id is None else sizes[layer.shard_index(shard_id)]
            if spec.strategy == "tensor":
                expected = (1,)
                expanded = loaded.reshape(1, 1).expand(rows, 1) if loaded.numel() == 1 else None
            else:
                bn = spec.block[0] if spec.strategy == "block" else 1
                cols = 1 if spec.cols_per_scale is None else math.ceil(layer.input_size / spec.cols_per_scale)
                expected = (math.ceil(rows / bn), cols)
                fits = loaded.dim() == 2 and tuple(loaded.shape) == expected
                expanded = loaded.repeat_interleave(bn, dim=0)[:rows] if fits else None
            if expanded is None:
                raise ValueError(f"{self.layer_name}.{spec.scale_name}{'' if shard_id is None else f' ({shard_id})'}: "
                                 f"checkpoint shape {tuple(loaded.shape)}, expected {expected} ({spec.source}, "
                                 f"{spec.strategy} scales)")
            layer.weight_loader(param, expanded.float(), shard_id)

        return load

    def process_after_loading(self, layer: nn.Module) -> None:
        name = self.spec.scale_name
        weight, scales = layer.weight.detach(), layer.get_parameter(name).detach()
        if not bool(torch.isfinite(scales).all()):
            raise ValueError(f"{self.layer_name}.{name} must be finite")
        K = weight.shape[1]
        group, cols = self._kernel_group(layer, K), self.spec.cols_per_scale
        if cols is not None and group != cols:  # a partial last block: groups of gcd(K, bk), each block's scale
            scales = scales.repeat_interleave(cols // group, dim=1)[:, : K // group]
        packed = ops.pack_wna16(weight, scales, weight_type="fp8_e4m3",
                                scale_dtype=compact_dtype(scales, self.model_dtype))
        for param_name in ("weight", name):
            delattr(layer, param_name)
        layer.register_parameter("wna16_qweight", nn.Parameter(packed.qweight, requires_grad=False))
        layer.register_parameter("wna16_scales", nn.Parameter(packed.scales, requires_grad=False))

    # -------------------------------------------------------------------------------------- inference

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = ops.wna16_gemm(x2, layer.wna16_qweight, layer.wna16_scales, None, None, "fp8_e4m3", x.dtype, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Fp8BlockLinearMethod(Fp8WeightOnlyLinearMethod):
    """A block-FP8 linear layer run W8A8, as its checkpoint asks: the input quantized to e4m3 per token and `bk`
    features (`ops.quant_fp8_per_group`), then the W8A8 block GEMM over the weight and its per-row block scales
    as loaded (`ops.block_fp8_mm`). Loading and the tensor-parallel rules are the weight-only method's."""

    runs_as = "the W8A8 block GEMM of fp8_block_activations='fp8'"

    def _kernel_group(self, layer: nn.Module, K: int) -> int:
        spec, cols = self.spec, self.spec.cols_per_scale
        assert spec.strategy == "block" and cols is not None
        try:
            ops.block_fp8_k_step(cols)
        except ValueError:
            raise ConfigError(f"invalid {spec.setting} for {self._where()}: blocks of {cols} input features must be "
                              "a multiple of 32; use fp8_block_activations='model_dtype'") from None
        self._check_rank_blocks(layer, K)
        return cols

    def process_after_loading(self, layer: nn.Module) -> None:
        scales = layer.get_parameter(self.spec.scale_name).detach()
        if not bool(torch.isfinite(scales).all()):
            raise ValueError(f"{self.layer_name}.{self.spec.scale_name} must be finite")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        group = self.spec.cols_per_scale
        x2 = x.reshape(-1, x.shape[-1])
        q, scale = ops.quant_fp8_per_group(x2, group)
        out = ops.block_fp8_mm(q, layer.weight, scale, layer.get_parameter(self.spec.scale_name), group, x.dtype,
                               bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])
