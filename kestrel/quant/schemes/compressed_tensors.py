"""`quant_method: "compressed-tensors"` checkpoints, as llm-compressor writes them: `float-quantized` FP8 and
`int-quantized` INT8 W8A8 (per-channel or per-tensor weights; dynamic per-token or static per-tensor inputs,
asymmetric INT8 inputs with a zero point), per-tensor FP8 KV-cache scales (`kv_cache_scheme`), and weight-only
INT4 / INT8 groups (no `input_activations`: llm-compressor's W4A16, W4A16_ASYM, W8A16) in `pack-quantized` or
`int-quantized` format, per group or per channel, symmetric or with zero points, optionally act-ordered
(`actorder: "group"`, `weight_g_idx`), run by the weight-only method (`kestrel.quant.wna16`).
FP8 weights the W8A8 GEMM cannot run (`float-quantized` or `naive-quantized`, 8-bit float): weight-only groups
(W8A16-FP8: no `input_activations`; per channel, group, block or tensor) and block-wise W8A8 (llm-compressor's
`FP8_BLOCK`: `block_structure [bn, bk]`, inputs dynamic per group of bk) run their dense layers weight-only
(`kestrel.quant.fp8_weight_only`: activations in the model dtype); `FP8_BLOCK` experts run the fused MoE kernel's
block path.

Everything else (INT block quantization, other bit widths, asymmetric or group-wise W8A8 weights, static inputs
with block weights, sparsity, transforms) is a ConfigError naming the scheme and the config group, raised before
any weight is read.
"""

from __future__ import annotations

from typing import Any

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.checkpoint import LinearScheme, TargetGroup, W8A8Scheme
from kestrel.quant.fp8_weight_only import Fp8WeightSpec
from kestrel.quant.scheme import register_scheme
from kestrel.quant.wna16 import GROUP_MULTIPLE, WNA16Spec

_SUPPORTED_FORMATS = ("float-quantized", "int-quantized")
_WEIGHT_ONLY_FORMATS = ("pack-quantized", "int-quantized")
# llm-compressor writes FP8 weight-only groups as naive-quantized, W8A8 ones as float-quantized: e4m3 `weight` both.
_FP8_WEIGHT_FORMATS = ("float-quantized", "naive-quantized")
_ACT_ORDER = {None: False, False: False, "weight": False, "static": False, True: True, "group": True, "dynamic": True}


@register_scheme("compressed-tensors")
class CompressedTensorsScheme(W8A8Scheme):
    loads_checkpoints = True

    @classmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> CompressedTensorsScheme:
        if isinstance(config, QuantConfig):
            raise ConfigError("invalid quantization='compressed-tensors': it names a checkpoint format, which "
                              "needs a checkpoint with a quantization_config; quantize at load with "
                              "quantization='fp8' or 'int8'")
        if config.get("sparsity_config"):
            raise ConfigError("invalid quantization_config.sparsity_config: sparse compressed-tensors checkpoints "
                              "are not supported; dense W8A8 FP8 and INT8 ones load")
        if config.get("transform_config"):
            raise ConfigError("invalid quantization_config.transform_config: checkpoints with weight transforms are "
                              "not supported")
        groups = []
        for name, group in (config.get("config_groups") or {}).items():
            targets = tuple(group.get("targets") or ())
            fmt = group.get("format") or config.get("format")
            groups.append(TargetGroup(targets, _group_scheme(name, group, fmt, targets)))
        if not groups:
            raise ConfigError("invalid quantization_config: compressed-tensors config without config_groups")
        kv_cache_scheme = config.get("kv_cache_scheme")
        _check_kv_cache_scheme(kv_cache_scheme)
        return cls(groups, tuple(config.get("ignore") or ()), prequantized=True,
                   kv_cache_scales=bool(kv_cache_scheme))


def _group_scheme(name: str, group: dict[str, Any], fmt: str | None, targets: tuple[str, ...]) -> LinearScheme:
    where = f"config group {name!r} (targets {list(targets)})"
    weights = group.get("weights") or {}
    if (fmt in _WEIGHT_ONLY_FORMATS and not group.get("input_activations") and not group.get("output_activations")
            and weights.get("type") == "int"):
        return _weight_only_scheme(name, weights, fmt, where)
    inputs = group.get("input_activations")
    if (fmt in _FP8_WEIGHT_FORMATS and weights.get("type") == "float" and weights.get("num_bits") == 8
            and not group.get("output_activations") and (not inputs or weights.get("strategy") == "block")):
        return _fp8_weights_scheme(name, weights, inputs, where)
    if fmt not in _SUPPORTED_FORMATS:
        raise ConfigError(f"invalid quantization_config format {fmt!r} in {where}: kestrel loads "
                          f"{list(_SUPPORTED_FORMATS)} (W8A8 FP8 / INT8) and {list(_WEIGHT_ONLY_FORMATS)} "
                          "(weight-only INT4 / INT8); other packed and sparse formats are not supported")
    if group.get("output_activations"):
        raise ConfigError(f"invalid quantization_config in {where}: output activation quantization is not supported")
    kind = weights.get("type")
    if weights.get("num_bits") != 8 or kind not in ("float", "int"):
        raise ConfigError(f"invalid quantization_config weights in {where}: {weights.get('num_bits')}-bit "
                          f"{kind} weights; only 8-bit float (FP8) and int (INT8) weights are supported")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor") or weights.get("group_size") or weights.get("block_structure"):
        raise ConfigError(f"invalid quantization_config weights strategy={strategy!r} in {where}: per-channel "
                          "and per-tensor weights are supported, group and block quantization are not")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise ConfigError(f"invalid quantization_config weights in {where}: weights must be symmetric and static")
    if not inputs:
        raise ConfigError(f"invalid quantization_config in {where}: {kind} weight-only quantization (no "
                          f"input_activations) in format {fmt!r} is not supported; W8A8 schemes and INT4 / INT8 "
                          f"weight-only ones in {list(_WEIGHT_ONLY_FORMATS)} are")
    if inputs.get("num_bits") != 8 or inputs.get("type") != kind:
        raise ConfigError(f"invalid quantization_config input_activations in {where}: expected 8-bit {kind} "
                          f"inputs like the weights, got {inputs.get('num_bits')}-bit {inputs.get('type')}")
    in_strategy, dynamic = inputs.get("strategy"), bool(inputs.get("dynamic"))
    if not ((in_strategy == "token" and dynamic) or (in_strategy == "tensor" and not dynamic)):
        raise ConfigError(f"invalid quantization_config input_activations in {where}: strategy={in_strategy!r} "
                          f"with dynamic={dynamic}; dynamic per-token or static per-tensor inputs are supported")
    symmetric = bool(inputs.get("symmetric", True))
    if kind == "float" and not symmetric:
        raise ConfigError(f"invalid quantization_config input_activations in {where}: asymmetric FP8 inputs")
    return LinearScheme("fp8" if kind == "float" else "int8", weight_per_tensor=strategy == "tensor",
                        static_input=not dynamic, symmetric_input=symmetric)


def _weight_only_scheme(name: str, weights: dict[str, Any], fmt: str, where: str) -> LinearScheme:
    """An INT4 / INT8 weight-only group: W4A16 / W8A16 on the weight-only kernel."""
    bits, strategy, group_size = weights.get("num_bits"), weights.get("strategy"), weights.get("group_size")
    if bits not in (4, 8):
        raise ConfigError(f"invalid quantization_config weights.num_bits={bits!r} in {where} ({fmt}): weight-only "
                          "INT weights load with 4 or 8 bits")
    if strategy not in ("group", "channel") or weights.get("block_structure"):
        raise ConfigError(f"invalid quantization_config weights.strategy={strategy!r} in {where} ({fmt}): weight-only "
                          "INT weights load per group or per channel")
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0 or group_size % GROUP_MULTIPLE):
        raise ConfigError(f"invalid quantization_config weights.group_size={group_size!r} in {where} ({fmt}): "
                          f"expected a positive multiple of {GROUP_MULTIPLE} (the weight-only kernel's K step)")
    if weights.get("dynamic"):
        raise ConfigError(f"invalid quantization_config weights.dynamic={weights.get('dynamic')!r} in {where} "
                          f"({fmt}): weights must be static")
    actorder = weights.get("actorder")
    if actorder not in _ACT_ORDER:
        raise ConfigError(f"invalid quantization_config weights.actorder={actorder!r} in {where} ({fmt}): expected "
                          "one of 'group', 'weight' or none")
    grouped = strategy == "group"
    # Per channel (one group), act-order reorders nothing the kernel sees.
    spec = WNA16Spec(fmt, bits, group_size if grouped else -1, bool(weights.get("symmetric", True)),
                     _ACT_ORDER[actorder] and grouped, source=f"compressed-tensors {fmt}, config group {name!r}",
                     group_field="quantization_config weights.group_size", act_order_field="weights.actorder='group'")
    return LinearScheme(spec.name, weight_per_tensor=False, static_input=False, weight_only=spec)


def _fp8_weights_scheme(name: str, weights: dict[str, Any], inputs: dict[str, Any] | None,
                        where: str) -> LinearScheme:
    """8-bit float weights whose dense layers run weight-only: a weight-only group, or block weights with inputs
    quantized dynamically per group of the block's columns (FP8_BLOCK)."""
    strategy = weights.get("strategy")
    if strategy not in ("block", "group", "channel", "tensor"):
        raise ConfigError(f"invalid quantization_config weights.strategy={strategy!r} in {where}: FP8 weights load "
                          "per block, group, channel or tensor")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise ConfigError(f"invalid quantization_config weights in {where}: weights must be symmetric and static")
    block, field_name = None, "weights.block_structure"
    if strategy == "block":
        block = weights.get("block_structure")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"invalid quantization_config weights.block_structure={block!r} in {where}: expected "
                              "[bn, bk], two positive integers")
        block = (block[0], block[1])
    elif strategy == "group":
        size, field_name = weights.get("group_size"), "weights.group_size"
        if not isinstance(size, int) or size <= 0:
            raise ConfigError(f"invalid quantization_config weights.group_size={size!r} in {where}: expected a "
                              "positive integer")
        block = (1, size)
    if inputs:
        in_strategy, dynamic = inputs.get("strategy"), bool(inputs.get("dynamic"))
        if not dynamic:
            raise ConfigError(f"invalid quantization_config input_activations in {where}: static input scales with "
                              f"block weights (block_structure={list(block)}); block-wise FP8 takes dynamic inputs")
        if (inputs.get("num_bits") != 8 or inputs.get("type") != "float" or not inputs.get("symmetric", True)
                or in_strategy != "group" or inputs.get("group_size") != block[1]):
            raise ConfigError(f"invalid quantization_config input_activations in {where}: strategy={in_strategy!r}, "
                              f"group_size={inputs.get('group_size')!r}; block weights (block_structure="
                              f"{list(block)}) load with symmetric 8-bit float inputs per group of {block[1]}")
    spec = Fp8WeightSpec(strategy, "weight_scale", block, quantized_inputs=bool(inputs),
                         source=f"compressed-tensors FP8, config group {name!r}",
                         block_field=f"quantization_config {field_name}")
    return LinearScheme("fp8", weight_per_tensor=strategy == "tensor", static_input=False,
                        block_shape=block if strategy == "block" else None, fp8_weights=spec)


def _check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    if not scheme:
        return
    if scheme.get("num_bits") != 8 or scheme.get("type") != "float" or scheme.get("strategy", "tensor") != "tensor":
        raise ConfigError(f"invalid quantization_config.kv_cache_scheme={scheme!r}: only per-tensor FP8 KV cache "
                          "scales are supported")
