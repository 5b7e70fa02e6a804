"""Per-layer quantization methods, and the plan that hands each linear layer its method by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kestrel.config import QUANTIZATION_CHOICES, ConfigError, QuantConfig
from kestrel.quant.base import QuantMethod
from kestrel.quant.checkpoint import CheckpointQuantization, LinearScheme, parse_quantization_config
from kestrel.quant.unquantized import UnquantizedLinearMethod
from kestrel.quant.w8a8 import W8A8LinearMethod
from kestrel.quant.w8a8_fp8 import Fp8LinearMethod
from kestrel.quant.w8a8_int8 import Int8LinearMethod

_W8A8: dict[str, type[W8A8LinearMethod]] = {"fp8": Fp8LinearMethod, "int8": Int8LinearMethod}
# QuantConfig.method -> factory of the online methods (quantize on load). The names are config's one list;
# "compressed-tensors" names the checkpoint format, whose layers get their methods from the checkpoint.
QUANT_METHODS: dict[str, Callable[[QuantConfig], QuantMethod]] = {
    name: _W8A8[name] for name in QUANTIZATION_CHOICES if name in _W8A8}


@dataclass(frozen=True)
class QuantPlan:
    """Which QuantMethod each linear layer gets: the checkpoint's `quantization_config` when it has one, else
    the user's `quantization=` flag (quantization at load), else none."""

    user: QuantConfig | None = None
    checkpoint: CheckpointQuantization | None = None
    # Random weights (load_format="dummy"): layers quantized at load create their high-precision weight on the
    # meta device, and the loader fills and quantizes one layer at a time (a 70B model is 140 GB in BF16).
    random_weights: bool = False

    @classmethod
    def build(cls, quant_config: QuantConfig | None, hf_config: dict[str, Any]) -> QuantPlan:
        saved = hf_config.get("quantization_config")
        checkpoint = parse_quantization_config(saved) if saved else None
        if checkpoint is not None and quant_config is not None:
            _check_flags_against(quant_config, checkpoint)
        return cls(quant_config, checkpoint)

    def method_for(self, layer_name: str, parts: Sequence[str] = ()) -> QuantMethod:
        if self.checkpoint is not None:
            scheme = self.checkpoint.scheme_for_parts(layer_name, list(parts) or [layer_name])
            return UnquantizedLinearMethod() if scheme is None else _prequantized_method(scheme)
        config = self.user
        if config is None or config.method is None:
            return UnquantizedLinearMethod()
        factory = QUANT_METHODS.get(config.method)
        if factory is None:
            raise ConfigError(f"invalid quantization={config.method!r}: no method of that name quantizes at load "
                              f"(registered: {sorted(QUANT_METHODS)}); 'compressed-tensors' names a checkpoint "
                              f"format and needs a checkpoint with a quantization_config; layer {layer_name!r}")
        method = factory(config)
        if self.random_weights and isinstance(method, W8A8LinearMethod):
            method.defer_weight = True
        return method

    def check_unquantized(self, module_name: str) -> None:
        """Modules kestrel always runs in the model dtype (the LM head) must not be quantized in the checkpoint."""
        if self.checkpoint is not None and self.checkpoint.scheme_for(module_name) is not None:
            raise ConfigError(f"invalid quantization_config: the checkpoint quantizes {module_name!r}, which kestrel "
                              "runs unquantized; re-quantize with it in the ignore list")


def _prequantized_method(scheme: LinearScheme) -> QuantMethod:
    config = QuantConfig(method=scheme.method, activation_scheme=scheme.activation_scheme,
                         symmetric_activations=scheme.symmetric_input)
    return _W8A8[scheme.method](config, calibrated_inputs=scheme.static_input, prequantized=True,
                                weight_per_tensor=scheme.weight_per_tensor)


def _check_flags_against(config: QuantConfig, checkpoint: CheckpointQuantization) -> None:
    """Flags that contradict the checkpoint are an error; the checkpoint's own method name is accepted."""
    if config.method not in (None, checkpoint.quant_method):
        raise ConfigError(f"invalid quantization={config.method!r}: the checkpoint is quantized "
                          f"(quantization_config.quant_method={checkpoint.quant_method!r}); leave quantization unset "
                          f"or pass {checkpoint.quant_method!r} to load it as saved")
    defaults = QuantConfig()
    for field_name in ("activation_scheme", "symmetric_activations"):
        value = getattr(config, field_name)
        if value != getattr(defaults, field_name):
            raise ConfigError(f"invalid {field_name}={value!r}: the checkpoint's quantization_config sets the "
                              "activation quantization; leave it unset")


def get_quant_method(plan: QuantPlan | QuantConfig | None, layer_name: str, parts: Sequence[str] = ()) -> QuantMethod:
    """A fresh QuantMethod for the linear layer `layer_name` (e.g. "model.layers.0.self_attn.qkv_proj"), made of
    the checkpoint modules `parts` when it merges several (q_proj, k_proj, v_proj)."""
    if not isinstance(plan, QuantPlan):
        plan = QuantPlan(plan)
    return plan.method_for(layer_name, parts)


__all__ = ["QUANT_METHODS", "Fp8LinearMethod", "Int8LinearMethod", "QuantMethod", "QuantPlan",
           "UnquantizedLinearMethod", "get_quant_method"]
