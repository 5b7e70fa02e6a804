"""`quant_method: "gguf"`: the linear layers of a llama.cpp GGUF file whose tensors the weight-only kernel runs as
stored. Q8_0 (blocks of 32 int8 values, one fp16 scale: w = d * q) is symmetric INT8 in groups of 32 (W8A16), Q4_0
(blocks of 32 4-bit codes, one fp16 scale: w = d * (c - 8)) symmetric INT4 in groups of 32 (W4A16): both are the
`int-quantized` layout of `kestrel.quant.wna16` with group size 32, which the GGUF loader
(`kestrel.loader.gguf_weights`) unpacks the blocks into (`weight` int8 [N, K], `weight_scale` [N, K / 32]).

The GGUF config reader (`kestrel.loader.gguf_config`) writes this scheme's `quantization_config`: `modules`, the
checkpoint modules whose weight is stored in a kernel type, by type. A layer goes onto the kernel when every
checkpoint module it merges (q, k, v; gate, up) is stored in one kernel type; any other layer (a mix of types, or
types without a kernel layout, such as the K-quants) is dequantized at load by the loader and runs in the model
dtype, so `get_quant_method` returns None for it. The loader asks the built model which modules went onto the kernel
(`GGUFLinearMethod.parts`), so the two never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.scheme import LINEAR, LayerKind, QuantScheme, register_scheme
from kestrel.quant.wna16 import WNA16LinearMethod, WNA16Spec

GGUF_GROUP = 32  # the block of Q8_0 and Q4_0
KERNEL_TYPES: dict[str, int] = {"Q8_0": 8, "Q4_0": 4}  # GGML type -> bits on the weight-only kernel
_WHERE = "quant_method='gguf'"


class GGUFLinearMethod(WNA16LinearMethod):
    """A weight-only layer fed from GGUF blocks; `parts` are the checkpoint modules it is made of, `ggml_type` their
    GGML type (what the loader reads to unpack their blocks rather than dequantize them)."""

    def __init__(self, ggml_type: str, layer_name: str, parts: tuple[str, ...]) -> None:
        spec = WNA16Spec("int-quantized", KERNEL_TYPES[ggml_type], GGUF_GROUP, symmetric=True, act_order=False,
                         source=f"GGUF {ggml_type}")
        super().__init__(spec, layer_name)
        self.ggml_type = ggml_type
        self.parts = parts


@register_scheme("gguf")
class GGUFScheme(QuantScheme):
    loads_checkpoints = True
    prequantized = True

    def __init__(self, modules: dict[str, str]) -> None:
        self.modules = modules

    @classmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> GGUFScheme:
        if isinstance(config, QuantConfig):
            raise ConfigError("invalid quantization='gguf': it names a checkpoint format; pass the path of a .gguf "
                              "file as the model")
        modules = config.get("modules")
        if not isinstance(modules, dict) or not all(isinstance(k, str) for k in modules):
            raise ConfigError(f"invalid quantization_config.modules ({_WHERE}): expected checkpoint module -> GGML "
                              "type")
        unknown = sorted({t for t in modules.values() if t not in KERNEL_TYPES})
        if unknown:
            raise ConfigError(f"invalid quantization_config.modules ({_WHERE}): types {unknown} have no kernel "
                              f"layout; expected {sorted(KERNEL_TYPES)}")
        return cls(dict(modules))

    @property
    def precision(self) -> str:
        return "gguf"

    def get_quant_method(self, kind: LayerKind, prefix: str,
                         parts: Sequence[str] = ()) -> QuantMethod | FusedMoEMethod | None:
        if kind != LINEAR:
            return None  # experts and the like are dequantized by the loader
        parts = tuple(parts) or (prefix,)
        types = {self.modules.get(part) for part in parts}
        if len(types) != 1 or None in types:
            return None
        return GGUFLinearMethod(types.pop(), prefix, parts)


def kernel_modules(model: nn.Module) -> dict[str, str]:
    """Checkpoint module -> GGML type of every module a built model runs on the weight-only kernel."""
    found: dict[str, str] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, GGUFLinearMethod):
            found.update(dict.fromkeys(method.parts, method.ggml_type))
    return found
