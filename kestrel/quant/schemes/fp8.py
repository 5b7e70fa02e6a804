"""FP8 (e4m3) W8A8 under the name "fp8", from either source:
- a checkpoint with `quant_method: "fp8"` (vLLM's format): per-tensor FP8 weights (`weight_scale`), activations
  static (`input_scale`) or dynamic per token as `activation_scheme` says; `ignored_layers` (or
  `modules_to_not_convert`) stay unquantized; block-wise weights (`weight_block_size`) are a ConfigError;
- `quantization="fp8"` on a high-precision checkpoint: every linear layer quantized at load, per-channel
  weights (absmax / 448), dynamic per-token activations.
"""

from __future__ import annotations

from typing import Any

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.checkpoint import LinearScheme, TargetGroup, W8A8Scheme
from kestrel.quant.scheme import register_scheme


@register_scheme("fp8")
class Fp8Scheme(W8A8Scheme):
    loads_checkpoints = True
    quantizes_at_load = True

    @classmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> Fp8Scheme:
        if isinstance(config, QuantConfig):
            return cls.at_load(config, "fp8")
        if config.get("weight_block_size"):
            raise ConfigError(f"invalid quantization_config.weight_block_size={config['weight_block_size']!r}: "
                              "block-wise FP8 weights are not supported; per-tensor FP8 checkpoints load")
        activations = config.get("activation_scheme", "dynamic")
        if activations not in ("static", "dynamic"):
            raise ConfigError(f"invalid quantization_config.activation_scheme={activations!r}: expected 'static' or "
                              "'dynamic'")
        linear = LinearScheme("fp8", weight_per_tensor=True, static_input=activations == "static")
        ignore = tuple(config.get("ignored_layers") or config.get("modules_to_not_convert") or ())
        return cls((TargetGroup(("Linear",), linear),), ignore, prequantized=True)
