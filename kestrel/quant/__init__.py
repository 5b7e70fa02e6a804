"""Quantization: the schemes (registered by `kestrel/quant/schemes/`), their per-layer methods, and the plan that
picks a model's scheme and hands each layer its method by name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import kestrel.quant.schemes  # noqa: F401 - the built-in schemes register themselves
from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.fp8_moe import Fp8FusedMoEMethod
from kestrel.quant.scheme import (
    FUSED_MOE,
    KV_SCALE_NAMES,
    LINEAR,
    SCHEMES,
    UNQUANTIZED,
    KVScaleNames,
    LayerKind,
    QuantScheme,
    register_scheme,
    registered_schemes,
    scheme_from_checkpoint,
    scheme_from_flag,
)
from kestrel.quant.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from kestrel.quant.w8a8_fp8 import Fp8LinearMethod
from kestrel.quant.w8a8_int8 import Int8LinearMethod
from kestrel.quant.wna16 import WNA16LinearMethod


@dataclass(frozen=True)
class QuantPlan:
    """A model's quantization scheme and each layer's method: the checkpoint's `quantization_config` chooses the
    scheme when it has one (by its `quant_method`), else the user's `quantization=` flag (quantization at load),
    else none."""

    user: QuantConfig | None = None
    # None: derived from `user` (the flag's scheme, or none).
    scheme: QuantScheme | None = None
    # Random weights (load_format="dummy"): layers quantized at load create their high-precision weight on the
    # meta device, and the loader fills and quantizes one layer at a time (a 70B model is 140 GB in BF16).
    random_weights: bool = False

    def __post_init__(self) -> None:
        if self.scheme is None and self.user is not None:
            object.__setattr__(self, "scheme", scheme_from_flag(self.user))

    @classmethod
    def build(cls, quant_config: QuantConfig | None, hf_config: dict[str, Any]) -> QuantPlan:
        saved = hf_config.get("quantization_config")
        block_w8a8 = quant_config is not None and quant_config.fp8_block_activations == "fp8"
        if not saved:
            if block_w8a8:
                raise ConfigError("invalid fp8_block_activations='fp8': it runs the block-FP8 layers of a checkpoint "
                                  "W8A8, and this checkpoint has no quantization_config; leave it 'model_dtype'")
            return cls(quant_config)
        scheme = scheme_from_checkpoint(saved)
        if quant_config is not None:
            _check_flags_against(quant_config, scheme)
        return cls(quant_config, scheme.with_fp8_block_activations() if block_w8a8 else scheme)

    @property
    def checkpoint(self) -> QuantScheme | None:
        """The checkpoint's own scheme (its weights are stored quantized), or None."""
        return self.scheme if self.scheme is not None and self.scheme.prequantized else None

    @property
    def kv_scale_names(self) -> KVScaleNames:
        """How the checkpoint names its FP8 KV-cache scales (an unquantized checkpoint may carry them too)."""
        return self.scheme.kv_scale_names if self.scheme is not None else KV_SCALE_NAMES

    @property
    def declares_kv_cache_scales(self) -> bool:
        return self.scheme is not None and self.scheme.declares_kv_cache_scales

    def method_for(self, layer_name: str, parts: Sequence[str] = (),
                   kind: LayerKind = LINEAR) -> QuantMethod | FusedMoEMethod:
        if kind == UNQUANTIZED:
            self.check_unquantized(layer_name)
            return UnquantizedLinearMethod()
        method = None if self.scheme is None else self.scheme.get_quant_method(kind, layer_name, parts)
        if method is None:
            return UnquantizedFusedMoEMethod() if kind == FUSED_MOE else UnquantizedLinearMethod()
        if self.random_weights:
            method.defer_weight = True
        return method

    def check_unquantized(self, module_name: str) -> None:
        """Modules kestrel always runs in the model dtype (the LM head, a mixture of experts' router) must not be
        quantized in the checkpoint."""
        if self.scheme is not None:
            self.scheme.check_unquantized(module_name)


def _check_flags_against(config: QuantConfig, checkpoint: QuantScheme) -> None:
    """Flags that contradict the checkpoint are an error; the checkpoint's own scheme name is accepted."""
    if config.method not in (None, checkpoint.name):
        raise ConfigError(f"invalid quantization={config.method!r}: the checkpoint is quantized "
                          f"(quantization_config.quant_method={checkpoint.name!r}); leave quantization unset "
                          f"or pass {checkpoint.name!r} to load it as saved")
    defaults = QuantConfig()
    for field_name in ("activation_scheme", "symmetric_activations"):
        value = getattr(config, field_name)
        if value != getattr(defaults, field_name):
            raise ConfigError(f"invalid {field_name}={value!r}: the checkpoint's quantization_config sets the "
                              "activation quantization; leave it unset")


def get_quant_method(plan: QuantPlan | QuantConfig | None, layer_name: str, parts: Sequence[str] = (),
                     kind: LayerKind = LINEAR) -> QuantMethod | FusedMoEMethod:
    """A fresh method for the layer `layer_name` (e.g. "model.layers.0.self_attn.qkv_proj") of `kind`, made of
    the checkpoint modules `parts` when it merges several (q_proj, k_proj, v_proj): a QuantMethod for a linear
    layer, a FusedMoEMethod for a mixture of experts' experts (`kind=FUSED_MOE`, `parts` every expert's modules),
    the unquantized method for a layer that always runs in the model dtype (`kind=UNQUANTIZED`; a ConfigError
    when the checkpoint quantizes it). A scheme without a method for the kind raises a ConfigError naming the
    layer."""
    if not isinstance(plan, QuantPlan):
        plan = QuantPlan(plan)
    return plan.method_for(layer_name, parts, kind)


__all__ = ["FUSED_MOE", "KV_SCALE_NAMES", "LINEAR", "SCHEMES", "UNQUANTIZED", "Fp8FusedMoEMethod", "Fp8LinearMethod",
           "FusedMoEMethod", "Int8LinearMethod", "KVScaleNames", "LayerKind", "QuantMethod", "QuantPlan", "QuantScheme",
           "UnquantizedFusedMoEMethod", "UnquantizedLinearMethod", "WNA16LinearMethod", "get_quant_method",
           "register_scheme", "registered_schemes"]
