"""INT8 W8A8 quantized at load (`quantization="int8"` on a high-precision checkpoint): per-channel symmetric
weights (absmax / 127), dynamic per-token activations, symmetric or with a zero point
(`symmetric_activations=False`). INT8 checkpoints are compressed-tensors `int-quantized` ones."""

from __future__ import annotations

from typing import Any

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.checkpoint import W8A8Scheme
from kestrel.quant.scheme import register_scheme


@register_scheme("int8")
class Int8Scheme(W8A8Scheme):
    quantizes_at_load = True

    @classmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> Int8Scheme:
        if not isinstance(config, QuantConfig):
            raise ConfigError("invalid quantization_config.quant_method='int8': no checkpoint format of that name; "
                              "INT8 checkpoints load as compressed-tensors (int-quantized)")
        return cls.at_load(config, "int8")
