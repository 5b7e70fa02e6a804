"""What the W8A8 schemes share: a `LinearScheme` for each linear module, chosen by target patterns and an ignore
list, and the W8A8 method (FP8 or INT8) built from it.

Module matching follows compressed-tensors: a target or ignore entry is `Linear` (every linear layer), a module
name, or `re:` and a regular expression matched at the start of the name. A merged layer (qkv, gate_up) needs the
same scheme for all of its parts. Quantization at load is the same structure with one target, `Linear`.

A mixture of experts' experts are linear modules of the checkpoint too (`...mlp.experts.5.up_proj`): every one of
a layer's experts must have the same scheme, FP8 with dynamic per-token inputs (what the fused MoE kernel runs:
`Fp8FusedMoEMethod`); INT8 experts and static input scales are ConfigErrors naming the layer.
Weight-only groups (`LinearScheme.weight_only`, compressed-tensors W4A16 / W8A16) get the weight-only method
(`kestrel.quant.wna16`) for dense layers and are refused for experts. FP8 weights that the W8A8 GEMM's per-channel
scales cannot express (`LinearScheme.fp8_weights`: block-wise, as `weight_block_size` and compressed-tensors
`FP8_BLOCK` store them) and compressed-tensors FP8 weight-only groups run their dense layers weight-only
(`kestrel.quant.fp8_weight_only`); block experts with dynamic inputs run the fused MoE kernel's block path, FP8
weight-only experts are refused.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.fp8_moe import Fp8FusedMoEMethod
from kestrel.quant.fp8_weight_only import Fp8BlockLinearMethod, Fp8WeightOnlyLinearMethod, Fp8WeightSpec
from kestrel.quant.scheme import FUSED_MOE, LayerKind, QuantScheme, check_layer_kind, scheme_from_checkpoint
from kestrel.quant.w8a8 import W8A8LinearMethod
from kestrel.quant.w8a8_fp8 import Fp8LinearMethod
from kestrel.quant.w8a8_int8 import Int8LinearMethod
from kestrel.quant.wna16 import WNA16LinearMethod, WNA16Spec

# LinearScheme.method -> the W8A8 method class that runs it.
W8A8_METHODS: dict[str, type[W8A8LinearMethod]] = {"fp8": Fp8LinearMethod, "int8": Int8LinearMethod}


@dataclass(frozen=True)
class LinearScheme:
    """How one linear layer's weights are stored and its inputs quantized."""

    method: str  # "fp8" (e4m3) or "int8"
    weight_per_tensor: bool  # one weight scale per (shard of the) layer, else one per output channel
    static_input: bool  # a calibrated per-tensor input scale, else dynamic per-token scales
    symmetric_input: bool = True  # False: asymmetric INT8 inputs with a zero point
    block_shape: tuple[int, int] | None = None  # (bn, bk) block-wise FP8 weights
    weight_only: WNA16Spec | None = None  # weight-only (method "w4a16" / "w8a16"): no input quantization
    # FP8 weights whose dense layers run weight-only (block-wise, or a weight-only checkpoint): their scales.
    fp8_weights: Fp8WeightSpec | None = None

    @property
    def activation_scheme(self) -> str:
        return "static" if self.static_input else "dynamic"

    @property
    def label(self) -> str:
        """For messages: "fp8 dynamic", "int8 static", "w4a16", "w8a16-fp8"."""
        if self.fp8_weights is not None and not self.fp8_weights.quantized_inputs:
            return self.fp8_weights.name
        return self.method if self.weight_only is not None else f"{self.method} {self.activation_scheme}"


def _runs_w8a8(spec: Fp8WeightSpec) -> bool:
    """Block-FP8 weights whose checkpoint asks for inputs quantized per token and block (fp8_block_activations)."""
    return spec.strategy == "block" and spec.quantized_inputs


@dataclass(frozen=True)
class TargetGroup:
    targets: tuple[str, ...]
    scheme: LinearScheme


class W8A8Scheme(QuantScheme):
    """A W8A8 method per linear module, by the first group whose targets match the module's name (none when it
    is ignored or unmatched): weights as the checkpoint stores them (`prequantized`), or quantized at load."""

    def __init__(self, groups: Sequence[TargetGroup], ignore: Sequence[str] = (), *, prequantized: bool,
                 kv_cache_scales: bool = False) -> None:
        self.groups = tuple(groups)
        self.ignore = tuple(ignore)
        self.prequantized = prequantized
        self._kv_cache_scales = kv_cache_scales
        self.block_w8a8 = False  # the block layers that ask for quantized inputs run W8A8 (fp8_block_activations)

    @classmethod
    def at_load(cls, config: QuantConfig, method: str) -> Self:
        """Every linear layer quantized at load: per-channel weights, the flag's activation quantization."""
        scheme = LinearScheme(method, weight_per_tensor=False, static_input=config.activation_scheme == "static",
                              symmetric_input=config.symmetric_activations)
        return cls((TargetGroup(("Linear",), scheme),), prequantized=False)

    def with_fp8_block_activations(self) -> W8A8Scheme:
        if not any(g.scheme.fp8_weights is not None and _runs_w8a8(g.scheme.fp8_weights) for g in self.groups):
            return super().with_fp8_block_activations()
        scheme = copy.copy(self)
        scheme.block_w8a8 = True
        return scheme

    @property
    def precision(self) -> str:
        """The 8-bit type of the linear layers ("fp8", "int8", or "fp8+int8" when both occur)."""
        return "+".join(sorted({group.scheme.method for group in self.groups}))

    @property
    def declares_kv_cache_scales(self) -> bool:
        return self._kv_cache_scales

    def scheme_for(self, module_name: str) -> LinearScheme | None:
        """The scheme of a linear module, or None when it stays unquantized."""
        if any(matches(pattern, module_name) for pattern in self.ignore):
            return None
        for group in self.groups:
            if any(matches(target, module_name) for target in group.targets):
                return group.scheme
        return None

    def scheme_for_parts(self, layer_name: str, parts: Sequence[str]) -> LinearScheme | None:
        """One scheme for a merged layer made of the checkpoint modules `parts` (e.g. q, k and v)."""
        schemes = {part: self.scheme_for(part) for part in parts}
        distinct = set(schemes.values())
        if len(distinct) > 1:
            listed = ", ".join(f"{p}: {s.label if s else 'unquantized'}"
                               for p, s in schemes.items())
            raise ConfigError(f"invalid quantization_config: the modules merged into {layer_name} were saved "
                              f"with different schemes ({listed}); kestrel runs them as one GEMM")
        return distinct.pop()

    def get_quant_method(self, kind: LayerKind, prefix: str,
                         parts: Sequence[str] = ()) -> QuantMethod | FusedMoEMethod | None:
        if kind == FUSED_MOE:
            return self.experts_method(prefix, parts)
        check_layer_kind(self, kind, prefix)
        scheme = self.scheme_for_parts(prefix, list(parts) or [prefix])
        if scheme is None:
            return None
        if scheme.weight_only is not None:
            return WNA16LinearMethod(scheme.weight_only, prefix)
        if scheme.fp8_weights is not None:
            if self.block_w8a8 and _runs_w8a8(scheme.fp8_weights):
                return Fp8BlockLinearMethod(scheme.fp8_weights, prefix)
            return Fp8WeightOnlyLinearMethod(scheme.fp8_weights, prefix)
        config = QuantConfig(method=scheme.method, activation_scheme=scheme.activation_scheme,
                             symmetric_activations=scheme.symmetric_input)
        # Static input scales exist only where a calibration wrote them: in a checkpoint.
        return W8A8_METHODS[scheme.method](config, calibrated_inputs=scheme.static_input and self.prequantized,
                                           prequantized=self.prequantized, weight_per_tensor=scheme.weight_per_tensor)

    def experts_method(self, prefix: str, parts: Sequence[str]) -> FusedMoEMethod | None:
        """The method of the experts `prefix`, made of every expert's modules `parts`: one scheme for all of them."""
        schemes: dict[LinearScheme | None, str] = {}
        for part in parts or [prefix]:
            schemes.setdefault(self.scheme_for(part), part)
        if len(schemes) > 1:
            listed = ", ".join(f"{part}: {s.label if s else 'unquantized'}"
                               for s, part in schemes.items())
            raise ConfigError(f"invalid quantization_config: the experts of {prefix} were saved with different schemes "
                              f"(e.g. {listed}); kestrel runs them in one fused kernel")
        scheme = next(iter(schemes))
        if scheme is None:
            return None
        if scheme.method != "fp8":
            raise ConfigError(f"invalid quantization: scheme {self.name!r} quantizes the experts of {prefix!r} to "
                              f"{scheme.method.upper()}, and kestrel has no {scheme.method.upper()} kernel for "
                              "mixture-of-experts layers; FP8 experts (quantization='fp8', or an FP8 checkpoint) run")
        if scheme.fp8_weights is not None and not scheme.fp8_weights.quantized_inputs:
            raise ConfigError(f"invalid quantization_config for the experts of {prefix!r}: FP8 weight-only "
                              f"({scheme.fp8_weights.source}); the fused MoE kernel runs FP8 experts with FP8 inputs "
                              "(W8A8), which this checkpoint does not ask for; FP8 checkpoints with dynamic "
                              "activations load")
        if scheme.static_input:
            raise ConfigError(f"invalid quantization_config for the experts of {prefix!r}: static input scales; the "
                              "fused MoE kernel quantizes the experts' inputs dynamically per token (an FP8 checkpoint "
                              "with dynamic activations loads)")
        block_scale = "weight_scale_inv" if scheme.fp8_weights is None else scheme.fp8_weights.scale_name
        return Fp8FusedMoEMethod(prequantized=self.prequantized, weight_per_tensor=scheme.weight_per_tensor,
                                 block_shape=scheme.block_shape, block_scale_name=block_scale)

    def check_unquantized(self, module_name: str) -> None:
        if self.prequantized and self.scheme_for(module_name) is not None:
            raise ConfigError(f"invalid quantization_config: the checkpoint quantizes {module_name!r}, which kestrel "
                              "runs unquantized; re-quantize with it in the ignore list")


def matches(pattern: str, name: str) -> bool:
    """compressed-tensors matching: `re:` + a regular expression, a class name (`Linear`), or a module name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or pattern == name or name.endswith("." + pattern)


def parse_quantization_config(config: dict[str, Any]) -> QuantScheme:
    """The scheme of a checkpoint's `quantization_config` (through the registry; see `kestrel.quant.scheme`)."""
    return scheme_from_checkpoint(config)
