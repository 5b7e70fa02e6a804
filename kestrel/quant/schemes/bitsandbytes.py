"""`quant_method: "bitsandbytes"` checkpoints (transformers' BitsAndBytesConfig): LLM.int8 (`load_in_8bit`) and 4-bit
NF4 / FP4 (`load_in_4bit`, `bnb_4bit_quant_type`, `bnb_4bit_use_double_quant`), run as weight-only layers
(`kestrel.quant.bnb`: W8A16 per channel, W4A16 with bitsandbytes' code books per block).

Every linear layer of the decoder is quantized except those `llm_int8_skip_modules` names, matched as transformers
matches them: a regular expression matched at the start of the module name (alone or followed by "."), or a suffix
of it. Without a list, transformers leaves the LM head (and tied or output embeddings) unconverted; with one, only
what it names, so a list that does not name the LM head means the checkpoint quantized it: a ConfigError, since
kestrel runs the LM head in the model dtype.

`llm_int8_threshold` is LLM.int8's outlier rule at inference: input columns holding a value above it are multiplied
in 16 bits, the rest quantized to int8 on the fly. kestrel never quantizes the inputs of these layers (W8A16), so
every column takes the 16-bit path the threshold reserves for outliers: the product is the exact one of the
dequantized weights, for any threshold (bitsandbytes' own result differs from it by the int8 rounding of the
columns below the threshold). `bnb_4bit_compute_dtype` is transformers' choice of the dtype to compute in; kestrel
computes in the model dtype (`dtype=`). Refused with a ConfigError naming the setting: both or neither of
`load_in_8bit` / `load_in_4bit`, quant types other than nf4 / fp4, `llm_int8_has_fp16_weight` (the checkpoint holds
16-bit weights, quantized by bitsandbytes at each forward), `llm_int8_enable_fp32_cpu_offload` (modules transformers
offloaded to the CPU stayed unquantized, and the config does not say which), a quantized LM head, and
mixture-of-experts experts (no weight-only MoE kernel yet).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.bnb import QUANT_TYPES, Bnb4bitLinearMethod, BnbInt8LinearMethod
from kestrel.quant.scheme import LayerKind, QuantScheme, check_layer_kind, register_scheme

_WHERE = "quant_method='bitsandbytes'"


@register_scheme("bitsandbytes")
class BitsAndBytesScheme(QuantScheme):
    loads_checkpoints = True
    prequantized = True

    def __init__(self, bits: int, quant_type: str, double_quant: bool, skip: tuple[str, ...] | None) -> None:
        self.bits = bits
        self.quant_type = quant_type  # "" for 8 bits
        self.double_quant = double_quant
        self.skip = skip  # None: transformers' default (the LM head only, for a decoder)

    @classmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> BitsAndBytesScheme:
        if isinstance(config, QuantConfig):
            raise ConfigError("invalid quantization='bitsandbytes': it names a checkpoint format, which needs a "
                              "checkpoint with a bitsandbytes quantization_config")
        eight = _flag(config, "load_in_8bit")
        four = _flag(config, "load_in_4bit")
        if eight == four:
            raise ConfigError(f"invalid quantization_config ({_WHERE}): load_in_8bit={eight} and load_in_4bit={four}; "
                              "exactly one of them must be true")
        for name, why in (("llm_int8_has_fp16_weight", "the checkpoint holds 16-bit weights that bitsandbytes "
                                                       "quantizes at each forward; load it without its "
                                                       "quantization_config, or with quantization='int8'"),
                          ("llm_int8_enable_fp32_cpu_offload", "the modules transformers offloaded to the CPU were "
                                                               "left unquantized, and the config does not say which")):
            if _flag(config, name):
                raise ConfigError(f"invalid quantization_config.{name}=True ({_WHERE}): {why}")
        threshold = config.get("llm_int8_threshold", 6.0)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
            raise ConfigError(f"invalid quantization_config.llm_int8_threshold={threshold!r} ({_WHERE}): expected a "
                              "number >= 0")
        skip = config.get("llm_int8_skip_modules")
        if skip is not None:
            if not isinstance(skip, list) or not all(isinstance(name, str) for name in skip):
                raise ConfigError(f"invalid quantization_config.llm_int8_skip_modules={skip!r} ({_WHERE}): expected "
                                  "a list of module names")
            for name in skip:
                try:
                    re.compile(name)
                except re.error as e:
                    raise ConfigError(f"invalid quantization_config.llm_int8_skip_modules entry {name!r} ({_WHERE}): "
                                      f"not a regular expression ({e})") from None
            skip = tuple(skip)
        if eight:
            return cls(8, "", False, skip)
        quant_type = config.get("bnb_4bit_quant_type", "fp4")
        if quant_type not in QUANT_TYPES:
            raise ConfigError(f"invalid quantization_config.bnb_4bit_quant_type={quant_type!r} ({_WHERE}): expected "
                              f"one of {list(QUANT_TYPES)}")
        storage = config.get("bnb_4bit_quant_storage", "uint8")
        if not isinstance(storage, str) or not isinstance(getattr(torch, storage, None), torch.dtype):
            raise ConfigError(f"invalid quantization_config.bnb_4bit_quant_storage={storage!r} ({_WHERE}): expected "
                              "a torch dtype name (the packed bytes are read whatever dtype holds them)")
        return cls(4, quant_type, _flag(config, "bnb_4bit_use_double_quant"), skip)

    @property
    def precision(self) -> str:
        return "int8" if self.bits == 8 else self.quant_type

    def skipped(self, module_name: str) -> bool:
        """transformers' rule for a module bitsandbytes leaves in 16 bits."""
        if self.skip is None:
            return module_name == "lm_head"
        return any(re.match(f"{name}\\.", module_name) or re.match(name, module_name) or module_name.endswith(name)
                   for name in self.skip)

    def get_quant_method(self, kind: LayerKind, prefix: str,
                         parts: Sequence[str] = ()) -> QuantMethod | FusedMoEMethod | None:
        check_layer_kind(self, kind, prefix)
        skipped = {part: self.skipped(part) for part in list(parts) or [prefix]}
        if len(set(skipped.values())) > 1:
            listed = ", ".join(f"{part}: {'skipped' if s else 'quantized'}" for part, s in skipped.items())
            raise ConfigError(f"invalid quantization_config.llm_int8_skip_modules ({_WHERE}): the modules merged "
                              f"into {prefix} are not all skipped or all quantized ({listed}); kestrel runs them as "
                              "one GEMM")
        if next(iter(skipped.values())):
            return None
        if self.bits == 8:
            return BnbInt8LinearMethod(prefix)
        return Bnb4bitLinearMethod(prefix, parts, self.quant_type, self.double_quant)

    def check_unquantized(self, module_name: str) -> None:
        if not self.skipped(module_name):
            raise ConfigError(f"invalid quantization_config.llm_int8_skip_modules={list(self.skip or ())} ({_WHERE}): "
                              f"it does not name {module_name!r}, so transformers quantized it, and kestrel runs it in "
                              "the model dtype")


def _flag(config: dict[str, Any], name: str) -> bool:
    value = config.get(name, False)
    if not isinstance(value, bool):
        raise ConfigError(f"invalid quantization_config.{name}={value!r} ({_WHERE}): expected true or false")
    return value
