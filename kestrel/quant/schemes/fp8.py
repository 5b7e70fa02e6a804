"""FP8 (e4m3) W8A8 under the name "fp8", from either source:
- a checkpoint with `quant_method: "fp8"` (vLLM's format): per-tensor FP8 weights (`weight_scale`), activations
  static (`input_scale`) or dynamic per token as `activation_scheme` says; `ignored_layers` (or
  `modules_to_not_convert`) stay unquantized. Block-wise weights (`weight_block_size: [bn, bk]`,
  `weight_scale_inv` per module, dynamic activations: DeepSeek-V3, the Qwen3 FP8 releases): the experts of a
  mixture of experts on the fused MoE kernel's block path (W8A8, inputs per token and bk columns), the dense layers
  weight-only with model-dtype activations (`kestrel.quant.fp8_weight_only`: vLLM quantizes those inputs too);
- `quantization="fp8"` on a high-precision checkpoint: every linear layer and every mixture of experts' experts
  quantized at load, per-channel weights (absmax / 448), dynamic per-token activations.
"""

from __future__ import annotations

from typing import Any

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.checkpoint import LinearScheme, TargetGroup, W8A8Scheme
from kestrel.quant.fp8_weight_only import Fp8WeightSpec
from kestrel.quant.scheme import register_scheme


@register_scheme("fp8")
class Fp8Scheme(W8A8Scheme):
    loads_checkpoints = True
    quantizes_at_load = True

    @classmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> Fp8Scheme:
        if isinstance(config, QuantConfig):
            return cls.at_load(config, "fp8")
        activations = config.get("activation_scheme", "dynamic")
        if activations not in ("static", "dynamic"):
            raise ConfigError(f"invalid quantization_config.activation_scheme={activations!r}: expected 'static' or "
                              "'dynamic'")
        block = config.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ConfigError(f"invalid quantization_config.weight_block_size={block!r}: expected [bn, bk], two "
                                  "positive integers")
            if activations != "dynamic":
                raise ConfigError("invalid quantization_config.activation_scheme='static' with weight_block_size: "
                                  "block-wise FP8 weights take dynamic activations")
            block = (block[0], block[1])
            weights = Fp8WeightSpec("block", "weight_scale_inv", block, quantized_inputs=True,
                                    source="quant_method 'fp8' with weight_block_size",
                                    block_field="quantization_config.weight_block_size")
            linear = LinearScheme("fp8", weight_per_tensor=False, static_input=False, block_shape=block,
                                  fp8_weights=weights)
        else:
            linear = LinearScheme("fp8", weight_per_tensor=True, static_input=activations == "static")
        ignore = tuple(config.get("ignored_layers") or config.get("modules_to_not_convert") or ())
        return cls((TargetGroup(("Linear",), linear),), ignore, prequantized=True)
