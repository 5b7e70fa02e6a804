"""What the W8A8 methods (FP8 and INT8) share: per-channel weights, per-token or per-tensor activations.

Online mode (`LLM(..., quantization="fp8" | "int8")` on a BF16/FP16/FP32 checkpoint): the layer loads the
high-precision `weight [N, K]` exactly as the unquantized method does; `process_after_loading` replaces it
with `weight` (8-bit, still `[N, K]`) and `weight_scale [N, 1]` fp32, so `W ~= weight_scale * weight`.
Asymmetric INT8 activations also get `azp_adj [N]` int32 = the row sums of the quantized weight.

Pre-quantized checkpoints (`prequantized=True`, compressed-tensors or the `fp8` format): `weight` is created in
the 8-bit dtype and loaded as stored, with `weight_scale` per output channel `[N, 1]` or per tensor (one per
merged shard, expanded to the shard's rows after loading: exact, since the GEMM's epilogue scales each output
channel anyway). Static activation scales (one per tensor) only make sense once calibrated: with
`calibrated_inputs=True` the layer has `input_scale` (and, for asymmetric INT8, `input_zero_point`), one entry
per merged shard, required in the checkpoint. Online construction with activation_scheme="static" is a
ConfigError.

Output dtype: the GEMM writes bf16 or fp16. A float32 model gets the bf16 result widened back to float32,
so its quantized linears carry bf16 output precision (at most 2^-8 relative rounding, below the 8-bit
quantization error); float32 is meant for CPU tests, not for serving.

Decode-sized FP8 GEMV (W8A16): a dynamic symmetric FP8 layer (per-channel or per-tensor weight scales; not INT8,
not static input scales) whose weight shape `(N, K)` has an "fp8" entry in the GPU's `gemv` tuning table runs
`ops.gemv` for M <= the entry's `max_m` rows instead: the e4m3 weights dequantized in registers against the
model-dtype activations, no activation-quantizer launch. For those M, `input_quant(layer, M)` is None, so the fused
producers emit model-dtype activations. Without a table entry (any CPU, an unmeasured GPU) nothing changes. The
row-parallel (tensor-parallel input split) path always stays W8A8.

Row-parallel layers (input features split across the tensor-parallel group) quantize with the scales one
device would use: the per-token activation extremes and (online) the per-channel weight absmax are
max-reduced over the group first and appended as an extra column, so the quantizer (kernel or reference)
computes exactly the single-device scales, and the column is dropped again. Every rank's 8-bit values are
then the single-device ones; partial sums of a float32 model stay float32 and are rounded once after the sum.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError, QuantConfig
from kestrel.kernels import common
from kestrel.kernels.gemv import GemvConfig
from kestrel.kernels.quant_act import SCALE_FLOOR
from kestrel.kernels.quant_types import QuantAct
from kestrel.kernels.scaled_mm import SMALL_M
from kestrel.quant.base import InputQuant, QuantMethod, TensorParallelGroup, decode_gemv
from kestrel.quant.unquantized import UnquantizedLinearMethod

GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16)
INT8_MIN, INT8_MAX = -128, 127


def gated_gemm_on(device: torch.device) -> bool:
    """Whether FP8 gate/up layers on `device` take `scaled_mm_gated`: GPUs whose launch feature `gated_gemm` is on.
    It moves where the product is rounded, so the CPU (whose references run either way) keeps the two ops."""
    return device.type == "cuda" and common.launch_feature("gated_gemm", device)


class W8A8LinearMethod(QuantMethod):
    """Subclasses name the 8-bit dtype, quantize a weight row-wise and quantize activations per token."""

    quant_dtype: torch.dtype
    method_name: str

    def __init__(self, quant_config: QuantConfig, calibrated_inputs: bool = False, prequantized: bool = False,
                 weight_per_tensor: bool = False) -> None:
        self.static = quant_config.activation_scheme == "static"
        self.symmetric = quant_config.symmetric_activations
        self.prequantized = prequantized
        self.weight_per_tensor = weight_per_tensor and prequantized
        if self.static and not calibrated_inputs:
            raise ConfigError(
                f"invalid activation_scheme='static' for quantization={self.method_name!r}: online quantization "
                "of a high-precision checkpoint has no calibrated activation scales; use "
                "activation_scheme='dynamic' (per-token scales) or a checkpoint quantized with static input scales"
            )

    # ------------------------------------------------------------------------------------------ hooks

    @abstractmethod
    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`weight [N, K]` -> (8-bit `[N, K]`, fp32 scales `[N, 1]`)."""

    @abstractmethod
    def quantize_dynamic(self, x: torch.Tensor) -> QuantAct:
        """Per-token quantization of `x [M, K]`."""

    # ---------------------------------------------------------------------------------------- loading

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        num_shards = max(len(output_partition_sizes), 1)
        if self.prequantized:
            # Stored 8-bit weights load slice by slice like unquantized ones, in their own dtype.
            UnquantizedLinearMethod().create_weights(layer, input_size, output_partition_sizes, self.quant_dtype)
            if self.weight_per_tensor:
                _register_per_shard(layer, "weight_scale", torch.ones(num_shards, dtype=torch.float32))
            else:
                scale = nn.Parameter(torch.ones(sum(output_partition_sizes), 1, dtype=torch.float32),
                                     requires_grad=False)
                scale.output_dim = 0
                layer.register_parameter("weight_scale", scale)
        else:
            # The high-precision weight loads exactly like an unquantized one; process_after_loading converts it.
            with torch.device("meta") if self.defer_weight else contextlib.nullcontext():
                UnquantizedLinearMethod().create_weights(layer, input_size, output_partition_sizes, params_dtype)
        if self.static:
            _register_per_shard(layer, "input_scale", torch.ones(num_shards, dtype=torch.float32))
            if not self.symmetric:
                _register_per_shard(layer, "input_zero_point", torch.zeros(num_shards, dtype=torch.int32))

    def planned_weight_bytes(self, weight: nn.Parameter) -> tuple[int, int] | None:
        if self.prequantized:
            return None
        # The 8-bit weight and fp32 scales per output channel (and, asymmetric, int32 azp_adj) replace it.
        rows = weight.shape[0]
        after = weight.numel() * torch.empty((), dtype=self.quant_dtype).element_size()
        after += rows * 4 * (1 if self.symmetric else 2)
        # A deferred weight loads one layer at a time: only the quantized form stays.
        return (after if self.defer_weight else weight.numel() * weight.element_size()), after

    def process_after_loading(self, layer: nn.Module) -> None:
        if self.prequantized:
            q, scale = layer.weight.detach(), layer.weight_scale.detach().float()
            if self.weight_per_tensor:
                rows = torch.tensor(layer.output_partition_sizes, device=scale.device)
                scale = scale.repeat_interleave(rows).reshape(-1, 1)
            if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                raise ValueError("weight_scale must be positive and finite")
        else:
            q, scale = self.quantize_weight(layer.weight.detach())
        # Assigning new Parameters (rather than copying into the old ones) releases the high-precision weight.
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if not self.symmetric:
            layer.azp_adj = nn.Parameter(q.sum(dim=1, dtype=torch.int32), requires_grad=False)
        if self.static:
            self._merge_input_scales(layer)

    def _merge_input_scales(self, layer: nn.Module) -> None:
        """Merged shards (q, k, v) read the same input, so one per-tensor scale must cover every shard."""
        scales = layer.input_scale.detach().float()
        if not bool(torch.isfinite(scales).all() and (scales > 0).all()):
            raise ValueError(f"input_scale must be positive and finite, got {scales.tolist()}")
        if self.symmetric:
            layer.input_scale = nn.Parameter(scales.amax().reshape(1), requires_grad=False)
            return
        scale, zero_point = union_of_ranges(scales, layer.input_zero_point.detach())
        layer.input_scale = nn.Parameter(scale, requires_grad=False)
        layer.input_zero_point = nn.Parameter(zero_point, requires_grad=False)

    # -------------------------------------------------------------------------------------- inference

    def gemv_config(self, layer: nn.Module, num_tokens: int | None) -> GemvConfig | None:
        """The decode GEMV's config when it runs `num_tokens` rows of this layer (W8A16, model-dtype input), or None:
        W8A8. Only dynamic symmetric FP8 layers whose weight the GPU's table lists, up to its `max_m`."""
        if self.quant_dtype != torch.float8_e4m3fn or self.static or not self.symmetric:
            return None
        if layer.weight.dtype != torch.float8_e4m3fn:
            return None  # not processed yet
        return decode_gemv(layer, num_tokens)

    def input_quant(self, layer: nn.Module, num_tokens: int | None = None) -> InputQuant | None:
        if self.gemv_config(layer, num_tokens) is not None:
            return None
        if not self.static:
            return InputQuant(self.quant_dtype, self.symmetric)
        azp = None if self.symmetric else layer.input_zero_point
        return InputQuant(self.quant_dtype, self.symmetric, layer.input_scale, azp)

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> QuantAct:
        """`x [M, K]` -> 8-bit activations with scales (and zero points); the unfused producer."""
        spec = self.input_quant(layer)
        if spec.scale is not None:
            return ops.quant_static(x, spec.scale, spec.dtype, spec.azp)
        return self.quantize_dynamic(x)

    def apply_quantized(self, layer: nn.Module, act: QuantAct, out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None, gemm_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`[M, N]` in `out_dtype` from activations already quantized (by `quantize_input` or a fused producer).
        `gemm_dtype`: what the GEMM writes (default: bf16 unless `out_dtype` is a 16-bit one); float32 is for the
        partial sums of a tensor-parallel row layer of a float32 model (reference GEMM only)."""
        if gemm_dtype is None:
            gemm_dtype = out_dtype if out_dtype in GEMM_OUT_DTYPES else torch.bfloat16
        azp_adj = layer.azp_adj if act.azp is not None else None
        out = ops.scaled_mm(act.q, layer.weight, act.scale, layer.weight_scale, gemm_dtype, bias, azp_adj, act.azp)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor | QuantAct, activation: str,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """`ops.scaled_mm_gated` for dynamic symmetric FP8 layers of a 16-bit model at steps of more than SMALL_M
        rows (the decode sizes keep their GEMV / swapped tiles), on a GPU whose launch feature `gated_gemm` is on."""
        rows = x.q.shape[0] if isinstance(x, QuantAct) else x.numel() // x.shape[-1]
        out_dtype = layer.out_dtype
        if (self.quant_dtype != torch.float8_e4m3fn or self.static or not self.symmetric or rows <= SMALL_M
                or out_dtype not in GEMM_OUT_DTYPES or layer.weight.dtype != torch.float8_e4m3fn
                or not gated_gemm_on(layer.weight.device)):
            return None
        act = x if isinstance(x, QuantAct) else self.quantize_input(layer, x.reshape(rows, x.shape[-1]))
        out = ops.scaled_mm_gated(act.q, layer.weight, act.scale, layer.weight_scale, out_dtype, activation, bias)
        return out if isinstance(x, QuantAct) else out.reshape(*x.shape[:-1], out.shape[-1])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        gemv = self.gemv_config(layer, x2.shape[0])
        if gemv is not None:
            out = ops.gemv(x2, layer.weight, layer.weight_scale, x.dtype, bias, config=gemv)
        else:
            out = self.apply_quantized(layer, self.quantize_input(layer, x2), x.dtype, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    # ----------------------------------------------------------------------------------- row parallel

    def needs_global_input_scale(self, layer: nn.Module) -> bool:
        return not self.static

    def quantize_input_row_parallel(self, layer: nn.Module, x: torch.Tensor, group: TensorParallelGroup) -> QuantAct:
        """`x [M, K/tp]` with the per-token scale (and zero point) of the whole row: the group's extremes ride
        along as extra columns."""
        if not self.needs_global_input_scale(layer):
            return self.quantize_input(layer, x)
        if self.symmetric:
            pads = [group.all_reduce_max(x.abs().amax(dim=-1, keepdim=True))]
        else:
            hi = group.all_reduce_max(x.amax(dim=-1, keepdim=True))
            neg_lo = group.all_reduce_max(-x.amin(dim=-1, keepdim=True))
            pads = [hi, -neg_lo]
        act = self.quantize_dynamic(torch.cat([x, *pads], dim=-1))
        return QuantAct(act.q[:, : x.shape[-1]].contiguous(), act.scale, act.azp)

    def apply_quantized_row_parallel(self, layer: nn.Module, act: QuantAct, out_dtype: torch.dtype,
                                     bias: torch.Tensor | None, group: TensorParallelGroup) -> torch.Tensor:
        # Partial sums stay in float32 for a float32 model and are rounded once after the sum, as the one-device
        # GEMM rounds its (bf16) output once.
        partial = torch.float32 if out_dtype not in GEMM_OUT_DTYPES else out_dtype
        out = group.all_reduce(self.apply_quantized(layer, act, partial, bias, gemm_dtype=partial))
        if out_dtype not in GEMM_OUT_DTYPES:
            out = out.to(torch.bfloat16).to(out_dtype)
        return out

    def apply_row_parallel(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                           group: TensorParallelGroup) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        act = self.quantize_input_row_parallel(layer, x2, group)
        out = self.apply_quantized_row_parallel(layer, act, x.dtype, bias, group)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def process_after_loading_row_parallel(self, layer: nn.Module, group: TensorParallelGroup) -> None:
        if self.prequantized:
            self.process_after_loading(layer)
            return
        # Online quantization scales each output channel by its absmax over the whole row: append the group's
        # absmax as an extra input column, quantize, and drop the column.
        weight = layer.weight.detach()
        row_max = group.all_reduce_max(weight.abs().amax(dim=1, keepdim=True))
        layer.weight = nn.Parameter(torch.cat([weight, row_max], dim=1), requires_grad=False)
        self.process_after_loading(layer)
        layer.weight = nn.Parameter(layer.weight[:, :-1].contiguous(), requires_grad=False)
        if not self.symmetric:
            layer.azp_adj = nn.Parameter(layer.weight.sum(dim=1, dtype=torch.int32), requires_grad=False)


def _register_per_shard(layer: nn.Module, name: str, init: torch.Tensor) -> None:
    param = nn.Parameter(init, requires_grad=False)
    param.per_shard = True
    param.weight_loader = layer.weight_loader
    layer.register_parameter(name, param)


def absmax_scales(weight: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per-row fp32 scales `[N, 1]` that map each row's absmax to `qmax`; all-zero rows get the floor."""
    # abs and max are exact in any float dtype, so no fp32 copy of the whole weight is needed here.
    return (weight.abs().amax(dim=1, keepdim=True).float() / qmax).clamp(min=SCALE_FLOOR)


def scaled_copy(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`weight / scale` in a fresh fp32 tensor that the caller may round and clamp in place."""
    return weight.to(torch.float32, copy=True).div_(scale)


def union_of_ranges(scales: torch.Tensor, zero_points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One asymmetric INT8 (scale `[1]` fp32, zero point `[1]` int32) whose range covers each given one's."""
    if scales.numel() == 1:
        return scales.reshape(1), zero_points.to(torch.int32).reshape(1)
    z = zero_points.float()
    lo = (scales * (INT8_MIN - z)).amin().clamp(max=0.0)
    hi = (scales * (INT8_MAX - z)).amax().clamp(min=0.0)
    scale = ((hi - lo) / (INT8_MAX - INT8_MIN)).clamp(min=SCALE_FLOOR)
    zero_point = torch.round(INT8_MIN - lo / scale).clamp(INT8_MIN, INT8_MAX)
    return scale.reshape(1), zero_point.to(torch.int32).reshape(1)
