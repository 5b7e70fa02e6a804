"""Per-layer quantization methods and the registry that picks one from a QuantConfig."""

from __future__ import annotations

from collections.abc import Callable

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import QuantMethod
from kestrel.quant.unquantized import UnquantizedLinearMethod

# method name (QuantConfig.method) -> factory; quantized methods add themselves here.
QUANT_METHODS: dict[str, Callable[[QuantConfig], QuantMethod]] = {}


def get_quant_method(quant_config: QuantConfig | None, layer_name: str) -> QuantMethod:
    """A fresh QuantMethod for the linear layer `layer_name` (e.g. "model.layers.0.self_attn.qkv_proj")."""
    if quant_config is None or quant_config.method is None:
        return UnquantizedLinearMethod()
    factory = QUANT_METHODS.get(quant_config.method)
    if factory is None:
        registered = sorted(QUANT_METHODS) or "none yet"
        raise ConfigError(
            f"invalid quantization={quant_config.method!r}: no quantization method of that name is registered "
            f"(registered: {registered}); layer {layer_name!r}"
        )
    return factory(quant_config)


__all__ = ["QUANT_METHODS", "QuantMethod", "UnquantizedLinearMethod", "get_quant_method"]
