"""`quant_method: "gguf"`: the linear layers of a llama.cpp GGUF file, run on the weight-only kernel as stored. Each
quantized GGML type (`kestrel.quant.gguf_blocks.FORMS`) is integer values with one float scale per group of 16 or
32 and, for Q4_1 / Q5_1 and the K-quants with mins, one float offset per group: `w = s * v - m`. 4-bit types run as
int4 (W4A16), the 5-, 6- and 8-bit ones as int8 (W8A16), offsets as the kernel's float `zeros`. The GGUF loader
(`kestrel.loader.gguf_weights`) unpacks the blocks into the `int-quantized` layout of `kestrel.quant.wna16`
(`weight` int8 [N, K], `weight_scale` float32 [N, K / group]) plus `weight_min` float32 [N, K / group] where the
layer has offsets.

The GGUF config reader (`kestrel.loader.gguf_config`) writes this scheme's `quantization_config`: `modules`, the
checkpoint modules whose weight is stored in a quantized type, by type. A layer merged from several checkpoint
modules (q, k, v; gate, up) of different types runs in one form that holds them all (`gguf_blocks.merged_form`: the
wider values, the smaller group, offsets if any part has them; Q4_K_M's q / k in Q4_K beside v in Q6_K make an
int8 layer in groups of 16 with offsets). A layer with a part in a float type (F32 / F16 / BF16) is dequantized at
load and runs in the model dtype, so `get_quant_method` returns None for it. The loader asks the built model which
modules went onto the kernel, and in which form (`kernel_modules`), so the two never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.gguf_blocks import FORMS, BlockForm, merged_form
from kestrel.quant.scheme import LINEAR, LayerKind, QuantScheme, register_scheme
from kestrel.quant.wna16 import WNA16LinearMethod, WNA16Spec, compact_dtype, register_tagged

_WHERE = "quant_method='gguf'"


class GGUFLinearMethod(WNA16LinearMethod):
    """A weight-only layer fed from GGUF blocks; `parts` are the checkpoint modules it is made of, `ggml_types`
    theirs, `form` the one kernel form that holds them all (what the loader unpacks their blocks into)."""

    def __init__(self, ggml_types: tuple[str, ...], layer_name: str, parts: tuple[str, ...]) -> None:
        self.form = merged_form(ggml_types)
        spec = WNA16Spec("int-quantized", self.form.bits, self.form.group, symmetric=True, act_order=False,
                         source=f"GGUF {'/'.join(sorted(set(ggml_types)))}")
        super().__init__(spec, layer_name)
        self.ggml_types = ggml_types
        self.parts = parts

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_partition_sizes, params_dtype)
        if self.form.mins:
            mins = torch.empty(sum(output_partition_sizes), input_size // self.form.group, dtype=torch.float32)
            register_tagged(layer, "weight_min", mins, output_dim=0, input_dim=1, group_size=self.form.group)

    def process_after_loading(self, layer: nn.Module) -> None:
        scales = self.finite(layer, "weight_scale")
        mins = self.finite(layer, "weight_min") if self.form.mins else None
        weight = ops.pack_wna16(layer.weight.detach(), scales, mins, weight_type="int4" if self.form.bits == 4
                                else "int8", scale_dtype=compact_dtype(scales, self.model_dtype))
        self.install(layer, weight)


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
        unknown = sorted({t for t in modules.values() if t not in FORMS})
        if unknown:
            raise ConfigError(f"invalid quantization_config.modules ({_WHERE}): types {unknown} have no kernel "
                              f"layout; expected {sorted(FORMS)}")
        return cls(dict(modules))

    @property
    def precision(self) -> str:
        return "gguf"

    def get_quant_method(self, kind: LayerKind, prefix: str,
                         parts: Sequence[str] = ()) -> QuantMethod | FusedMoEMethod | None:
        if kind != LINEAR:
            return None  # experts and the like are dequantized by the loader
        parts = tuple(parts) or (prefix,)
        types = tuple(self.modules.get(part) for part in parts)
        if None in types:
            return None
        return GGUFLinearMethod(types, prefix, parts)


def kernel_modules(model: nn.Module) -> dict[str, BlockForm]:
    """Checkpoint module -> the kernel form of its layer, for every module a built model runs on the weight-only
    kernel."""
    found: dict[str, BlockForm] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, GGUFLinearMethod):
            found.update(dict.fromkeys(method.parts, method.form))
    return found
