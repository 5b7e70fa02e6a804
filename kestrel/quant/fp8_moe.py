"""W8A8-FP8 experts: float8_e4m3fn `w13_weight [E, 2I, H]` and `w2_weight [E, H, I]` with fp32 scales, run by the
fused MoE kernel (`ops.fused_moe`), which quantizes the activations itself, dynamically per token (x once per
token, the intermediate once per routed pair).

Weights, by source:
- quantized at load (`quantization="fp8"` on a high-precision checkpoint): the experts load in the model dtype,
  then each output channel is quantized at absmax / 448 (nearest-even e4m3): `w13_weight_scale [E, 2I, 1]`,
  `w2_weight_scale [E, H, 1]`. A down projection's row spans the whole intermediate dimension, which tensor
  parallelism splits: its absmax is max-reduced over the group first, so every rank holds the one-device scale.
- a per-channel checkpoint (compressed-tensors `channel` strategy: `weight_scale [N, 1]` per expert module): the
  same parameters, loaded as stored; per-tensor weights (`weight_scale [1]`) fill their module's rows.
- a block checkpoint (`weight_block_size: [bn, bk]`, `weight_scale_inv [ceil(N/bn), ceil(K/bk)]` per module, as
  DeepSeek-V3 and the Qwen3 FP8 releases; compressed-tensors `FP8_BLOCK` names them `weight_scale`):
  `w13_weight_scale [E, 2I/bn, ceil(H/bk)]`,
  `w2_weight_scale [E, ceil(H/bn), ceil(I/bk)]`; each rank's share of the intermediate dimension must hold whole
  blocks (gate and up rows may not share a block either), and activations are quantized per token and bk
  columns.

Tensor parallelism splits the intermediate dimension: w13 scales are split with their rows, w2's per-channel
scales run over H and are whole on every rank, block scales are split along their blocks. The intermediate's
per-token scale of the per-channel path is the group's (`reduce_inter_amax`), so the sharded model quantizes
exactly as one device does; expert parallelism holds whole experts and needs nothing.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError
from kestrel.kernels.common import FP8_DOT_MIN_K
from kestrel.kernels.quant_act import FP8_MAX, SCALE_FLOOR
from kestrel.quant.base import FusedMoEMethod, expert_param
from kestrel.quant.unquantized import UnquantizedFusedMoEMethod
from kestrel.quant.w8a8 import scaled_copy

FP8 = torch.float8_e4m3fn


class Fp8FusedMoEMethod(FusedMoEMethod):
    """`prequantized`: the checkpoint stores FP8 experts (per channel, per tensor with `weight_per_tensor`, or
    per block with `block_shape=(bn, bk)`); else the high-precision experts are quantized per channel at load."""

    def __init__(self, prequantized: bool = False, weight_per_tensor: bool = False,
                 block_shape: tuple[int, int] | None = None, block_scale_name: str = "weight_scale_inv") -> None:
        if block_shape is not None and (not prequantized or weight_per_tensor):
            raise ValueError("block FP8 experts come from a checkpoint with block scales")
        self.prequantized = prequantized
        self.weight_per_tensor = weight_per_tensor and prequantized
        self.block_shape = None if block_shape is None else (int(block_shape[0]), int(block_shape[1]))
        # The block scales' name under each expert module: vLLM's format, or compressed-tensors' "weight_scale".
        self.block_scale_name = block_scale_name

    # ---------------------------------------------------------------------------------------- loading

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        if not self.prequantized:
            # The high-precision experts load exactly like unquantized ones; process_after_loading converts them.
            # Random weights are created one layer at a time by the dummy loader (`defer_weight`), so a model whose
            # experts fit only in FP8 (Mixtral-8x7B on 80 GB) never holds them all in the model dtype.
            with torch.device("meta") if self.defer_weight else contextlib.nullcontext():
                UnquantizedFusedMoEMethod().create_weights(layer, num_experts, hidden_size, intermediate_size,
                                                           params_dtype)
            return
        E, H, inter = num_experts, hidden_size, intermediate_size
        layer.register_parameter("w13_weight", expert_param(torch.empty(E, 2 * inter, H, dtype=FP8), "w13",
                                                            "weight", 0))
        layer.register_parameter("w2_weight", expert_param(torch.empty(E, H, inter, dtype=FP8), "w2", "weight", 1))
        if self.block_shape is None:
            per_tensor = self.weight_per_tensor
            w13_scale = expert_param(torch.ones(E, 2 * inter, 1), "w13", "weight_scale", 0, per_tensor=per_tensor)
            w2_scale = expert_param(torch.ones(E, H, 1), "w2", "weight_scale", None, per_tensor=per_tensor)
        else:
            bn, bk = self.block_shape
            if inter % bn:
                raise ConfigError(f"invalid quantization_config.weight_block_size={[bn, bk]} for {layer.prefix}: "
                                  f"each rank's share {inter} of the experts' intermediate size is not a multiple of "
                                  f"{bn} (gate and up rows would share a scale block); use a tensor_parallel_size "
                                  "that keeps whole blocks, or enable_expert_parallel")
            name = self.block_scale_name
            w13_scale = expert_param(torch.ones(E, 2 * inter // bn, math.ceil(H / bk)), "w13", name, 0, block=bn)
            w2_scale = expert_param(torch.ones(E, math.ceil(H / bn), math.ceil(inter / bk)), "w2", name, 1, block=bk)
        layer.register_parameter("w13_weight_scale", w13_scale)
        layer.register_parameter("w2_weight_scale", w2_scale)

    def planned_weight_bytes(self, weight: nn.Parameter) -> tuple[int, int] | None:
        if self.prequantized:
            return None
        # The e4m3 weight and one fp32 scale per output channel (its last dimension is the input).
        after = weight.numel() + weight.numel() // weight.shape[-1] * 4
        return (after if self.defer_weight else weight.numel() * weight.element_size()), after

    def process_after_loading(self, layer: nn.Module) -> None:
        if self.block_shape is not None and self.block_shape[1] < FP8_DOT_MIN_K and layer.w13_weight.is_cuda:
            raise ConfigError(f"invalid quantization_config.weight_block_size={list(self.block_shape)} for "
                              f"{layer.prefix}: FP8 experts in blocks of {self.block_shape[1]} columns need FP8 dots "
                              f"over {self.block_shape[1]}, and a GPU's reduce over at least {FP8_DOT_MIN_K}; the "
                              f"fused MoE kernel runs blocks of at least {FP8_DOT_MIN_K} columns on a GPU (the "
                              "published checkpoints' are [128, 128]); such a checkpoint runs on the CPU")
        if self.prequantized:
            for name in ("w13_weight_scale", "w2_weight_scale"):
                scale = getattr(layer, name)
                if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                    raise ValueError(f"{layer.prefix}: the experts' weight scales must be positive and finite")
            return
        group = layer.intermediate_group
        w13, s13 = _quantize_rows(layer.w13_weight.detach())
        # A down projection's row runs over the intermediate dimension: its absmax over every rank's slice.
        w2 = layer.w2_weight.detach()
        amax = w2.abs().amax(dim=-1, keepdim=True).float()
        if group is not None:
            amax = group.all_reduce_max(amax)
        w2, s2 = _quantize_rows(w2, amax)
        # New Parameters (rather than copies into the old ones) release the high-precision experts.
        layer.w13_weight = nn.Parameter(w13, requires_grad=False)
        layer.w2_weight = nn.Parameter(w2, requires_grad=False)
        layer.w13_weight_scale = nn.Parameter(s13, requires_grad=False)
        layer.w2_weight_scale = nn.Parameter(s2, requires_grad=False)

    # -------------------------------------------------------------------------------------- inference

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str) -> torch.Tensor:
        group = layer.intermediate_group
        # Per channel, the intermediate's per-token scale spans the whole row: the group's max (block groups never
        # cross ranks).
        reduce = group.all_reduce_max if group is not None and self.block_shape is None else None
        return ops.fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation,
                             w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
                             block_shape=self.block_shape, reduce_inter_amax=reduce)


def _quantize_rows(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [E, N, K]` -> (float8_e4m3fn `[E, N, K]`, fp32 scales `[E, N, 1]` = absmax / 448, the floor for an
    all-zero row), nearest-even; `amax [E, N, 1]`: each row's absmax when it spans more than this rank holds. One
    expert at a time, so the fp32 working copy is one expert's."""
    if amax is None:
        amax = weight.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=SCALE_FLOOR)
    q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    for e in range(weight.shape[0]):
        q[e] = scaled_copy(weight[e], scale[e]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale
