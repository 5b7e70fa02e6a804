"""Per-layer quantization methods and the registry that picks one from a QuantConfig."""

from __future__ import annotations

from collections.abc import Callable

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import QuantMethod
from kestrel.quant.unquantized import UnquantizedLinearMethod
from kestrel.quant.w8a8_fp8 import Fp8LinearMethod
from kestrel.quant.w8a8_int8 import Int8LinearMethod

# method name (QuantConfig.method) -> factory. These build the online methods (quantize on load); checkpoint
# formats with pre-quantized weights and calibrated input scales construct their methods themselves.
QUANT_METHODS: dict[str, Callable[[QuantConfig], QuantMethod]] = {
    "fp8": Fp8LinearMethod,
    "int8": Int8LinearMethod,
}


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


__all__ = ["QUANT_METHODS", "Fp8LinearMethod", "Int8LinearMethod", "QuantMethod", "UnquantizedLinearMethod",
           "get_quant_method"]
