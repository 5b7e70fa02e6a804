"""The quantization a checkpoint was saved with: config.json's `quantization_config`, parsed once.

Two formats load: compressed-tensors (as llm-compressor writes it: `float-quantized` FP8 and `int-quantized`
INT8 W8A8) and the `quant_method: "fp8"` format (per-tensor FP8 weights, static or dynamic activations). Each
linear layer gets a `LinearScheme` by its Hugging Face module name (the checkpoint's `targets` and `ignore`
lists); a merged layer (qkv, gate_up) needs the same scheme for all of its parts. Everything else (group or
block quantization, weight-only and 4-bit schemes, asymmetric weights, sparsity) is a ConfigError naming the
scheme and the layers, raised before any weight is read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kestrel.config import ConfigError

CHECKPOINT_METHODS = ("compressed-tensors", "fp8")
_SUPPORTED_CT_FORMATS = ("float-quantized", "int-quantized")


@dataclass(frozen=True)
class LinearScheme:
    """How one linear layer's weights are stored and its inputs quantized."""

    method: str  # "fp8" (e4m3) or "int8"
    weight_per_tensor: bool  # one weight scale per (shard of the) layer, else one per output channel
    static_input: bool  # a calibrated per-tensor input scale, else dynamic per-token scales
    symmetric_input: bool = True  # False: asymmetric INT8 inputs with a zero point

    @property
    def activation_scheme(self) -> str:
        return "static" if self.static_input else "dynamic"


@dataclass(frozen=True)
class _Group:
    targets: tuple[str, ...]
    scheme: LinearScheme


@dataclass(frozen=True)
class CheckpointQuantization:
    """The parsed `quantization_config`: which scheme each linear module (HF name) was saved with."""

    quant_method: str
    groups: tuple[_Group, ...]
    ignore: tuple[str, ...]

    @property
    def precision(self) -> str:
        """The 8-bit type of the checkpoint's linear layers ("fp8", "int8", or "fp8+int8" when both occur)."""
        return "+".join(sorted({group.scheme.method for group in self.groups}))

    def scheme_for(self, module_name: str) -> LinearScheme | None:
        """The scheme of a linear module, or None when the checkpoint leaves it unquantized."""
        if any(_matches(pattern, module_name) for pattern in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(target, module_name) for target in group.targets):
                return group.scheme
        return None

    def scheme_for_parts(self, layer_name: str, parts: Sequence[str]) -> LinearScheme | None:
        """One scheme for a merged layer made of the checkpoint modules `parts` (e.g. q, k and v)."""
        schemes = {part: self.scheme_for(part) for part in parts}
        distinct = set(schemes.values())
        if len(distinct) > 1:
            listed = ", ".join(f"{p}: {s.method + ' ' + s.activation_scheme if s else 'unquantized'}"
                               for p, s in schemes.items())
            raise ConfigError(f"invalid quantization_config: the modules merged into {layer_name} were saved "
                              f"with different schemes ({listed}); kestrel runs them as one GEMM")
        return distinct.pop()


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors matching: `re:` + a regular expression, a class name (`Linear`), or a module name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or pattern == name or name.endswith("." + pattern)


def parse_quantization_config(config: dict[str, Any]) -> CheckpointQuantization:
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(config)
    if method == "fp8":
        return _parse_fp8(config)
    raise ConfigError(f"invalid quantization_config.quant_method={method!r} in config.json: kestrel loads "
                      f"{list(CHECKPOINT_METHODS)} checkpoints (W8A8 FP8 and INT8); quantize the original weights "
                      "with `kestrel quantize` or load them with quantization='fp8' or 'int8'")


def _parse_fp8(config: dict[str, Any]) -> CheckpointQuantization:
    if config.get("weight_block_size"):
        raise ConfigError(f"invalid quantization_config.weight_block_size={config['weight_block_size']!r}: "
                          "block-wise FP8 weights are not supported; per-tensor FP8 checkpoints load")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ConfigError(f"invalid quantization_config.activation_scheme={scheme!r}: expected 'static' or 'dynamic'")
    linear = LinearScheme("fp8", weight_per_tensor=True, static_input=scheme == "static")
    ignore = tuple(config.get("ignored_layers") or config.get("modules_to_not_convert") or ())
    return CheckpointQuantization("fp8", (_Group(("Linear",), linear),), ignore)


def _parse_compressed_tensors(config: dict[str, Any]) -> CheckpointQuantization:
    if config.get("sparsity_config"):
        raise ConfigError("invalid quantization_config.sparsity_config: sparse compressed-tensors checkpoints are "
                          "not supported; dense W8A8 FP8 and INT8 ones load")
    if config.get("transform_config"):
        raise ConfigError("invalid quantization_config.transform_config: checkpoints with weight transforms are "
                          "not supported")
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        targets = tuple(group.get("targets") or ())
        fmt = group.get("format") or config.get("format")
        groups.append(_Group(targets, _group_scheme(name, group, fmt, targets)))
    if not groups:
        raise ConfigError("invalid quantization_config: compressed-tensors config without config_groups")
    # The worker binds the per-layer k_scale / v_scale tensors (worker/kv_cache.py); here only the scheme is checked.
    _check_kv_cache_scheme(config.get("kv_cache_scheme"))
    return CheckpointQuantization("compressed-tensors", tuple(groups), tuple(config.get("ignore") or ()))


def _group_scheme(name: str, group: dict[str, Any], fmt: str | None, targets: tuple[str, ...]) -> LinearScheme:
    where = f"config group {name!r} (targets {list(targets)})"
    if fmt not in _SUPPORTED_CT_FORMATS:
        raise ConfigError(f"invalid quantization_config format {fmt!r} in {where}: kestrel loads "
                          f"{list(_SUPPORTED_CT_FORMATS)} (W8A8 FP8 / INT8); packed, weight-only and sparse "
                          "formats are not supported")
    weights = group.get("weights") or {}
    inputs = group.get("input_activations")
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
        raise ConfigError(f"invalid quantization_config in {where}: weight-only quantization (no input_activations) "
                          "is not supported; W8A8 schemes are")
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


def _check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    if not scheme:
        return
    if scheme.get("num_bits") != 8 or scheme.get("type") != "float" or scheme.get("strategy", "tensor") != "tensor":
        raise ConfigError(f"invalid quantization_config.kv_cache_scheme={scheme!r}: only per-tensor FP8 KV cache "
                          "scales are supported")
