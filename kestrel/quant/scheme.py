"""Quantization schemes: the registry of scheme classes and what every scheme answers.

A scheme is a way a model's weights are quantized: a checkpoint format (`quantization_config.quant_method` in
config.json: "compressed-tensors", "fp8") or a quantization applied at load (the `quantization=` flag: "fp8",
"int8"). Each scheme class lives in its own module under `kestrel/quant/schemes/` and registers itself with
`@register_scheme(name)`; importing `kestrel.quant` imports them all. `QuantPlan` picks the class by name
and builds the scheme with `from_config`; the scheme then hands each layer its `QuantMethod`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod

# The kinds of layers a scheme may be asked about; a scheme that does not know a kind raises a ConfigError.
LayerKind = Literal["linear", "fused_moe", "unquantized"]
LINEAR: LayerKind = "linear"
FUSED_MOE: LayerKind = "fused_moe"  # a mixture-of-experts layer's experts, all in one weight
# A linear layer kestrel always runs in the model dtype (a router, a shared expert's gate): the plan answers it
# without asking the scheme, after `check_unquantized` made sure the checkpoint did not quantize it.
UNQUANTIZED: LayerKind = "unquantized"


@dataclass(frozen=True)
class KVScaleNames:
    """Where a checkpoint keeps the per-tensor FP8 KV-cache scales of one attention module: suffixes relative to
    the attention module's checkpoint prefix (e.g. "model.layers.0.self_attn"), so no layer layout is assumed.
    Each tuple lists the names read, the first one being the name written."""

    key: tuple[str, ...]
    value: tuple[str, ...]

    def names(self, attention_prefix: str) -> dict[str, tuple[str, ...]]:
        """{"k": full names of the key scale, "v": ... of the value scale} of the attention module."""
        return {"k": tuple(f"{attention_prefix}.{s}" for s in self.key),
                "v": tuple(f"{attention_prefix}.{s}" for s in self.value)}

    def written(self, attention_prefix: str) -> tuple[str, str]:
        """The (key, value) scale names a writer gives the attention module's scales."""
        return f"{attention_prefix}.{self.key[0]}", f"{attention_prefix}.{self.value[0]}"

    @property
    def suffixes(self) -> tuple[str, ...]:
        """Every name read, each with its leading dot: what a loader recognizes (and skips) as a KV scale."""
        return tuple(f".{s}" for s in (*self.key, *self.value))

    def match(self, tensor_name: str) -> tuple[str, str] | None:
        """(attention prefix, "k" or "v") of a KV-scale tensor name, or None for any other tensor."""
        candidates = [(suffix, "k") for suffix in self.key] + [(suffix, "v") for suffix in self.value]
        # The longest suffix first: "attn.k_scale" also ends with "k_scale".
        for suffix, which in sorted(candidates, key=lambda c: -len(c[0])):
            if tensor_name.endswith("." + suffix):
                return tensor_name[: -len(suffix) - 1], which
        return None


# compressed-tensors and vLLM write `k_scale` / `v_scale` on the attention module, some exporters put them on
# its inner `attn`, and the older FP8 format stores the projections' `output_scale`.
KV_SCALE_NAMES = KVScaleNames(key=("k_scale", "attn.k_scale", "k_proj.output_scale"),
                              value=("v_scale", "attn.v_scale", "v_proj.output_scale"))


class QuantScheme(ABC):
    """One quantization scheme of a whole model, built once from its configuration."""

    name: ClassVar[str]  # the registered name (set by `register_scheme`)
    kv_scale_names: ClassVar[KVScaleNames] = KV_SCALE_NAMES
    # The sources `from_config` takes: a checkpoint's quantization_config, the quantization= flag.
    loads_checkpoints: ClassVar[bool] = False
    quantizes_at_load: ClassVar[bool] = False
    # This instance's source. True: the checkpoint stores the quantized weights (its quantization_config chose
    # the scheme); False: the weights are quantized at load from a high-precision checkpoint.
    prequantized: bool = False

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> QuantScheme:
        """The scheme from a checkpoint's `quantization_config` (a dict) or from the `quantization=` flag's
        QuantConfig (quantization at load). A source the scheme does not take, or a setting it does not
        support, is a ConfigError naming it, raised before any weight is read."""

    @abstractmethod
    def get_quant_method(self, kind: LayerKind, prefix: str,
                         parts: Sequence[str] = ()) -> QuantMethod | FusedMoEMethod | None:
        """A fresh method for the layer `prefix` (its checkpoint module name, e.g. "model.layers.0.mlp.down_proj"),
        made of the checkpoint modules `parts` when it merges several (q_proj, k_proj, v_proj); None: the layer
        stays unquantized. Kind `fused_moe` asks for a `FusedMoEMethod` of the experts `prefix`
        ("model.layers.0.mlp.experts"), whose `parts` are every expert's modules ("...experts.5.up_proj")."""

    def check_unquantized(self, module_name: str) -> None:  # noqa: B027 - optional hook
        """Raise a ConfigError when the scheme quantizes `module_name`, a module kestrel always runs in the
        model dtype (the LM head)."""

    @property
    def precision(self) -> str:
        """A short name of what the weights are stored as ("fp8", "int8"), for reports."""
        return self.name

    @property
    def declares_kv_cache_scales(self) -> bool:
        """True when the configuration promises FP8 KV-cache scales in the checkpoint (named by
        `kv_scale_names`)."""
        return False

    def with_fp8_block_activations(self) -> QuantScheme:
        """This scheme with the block-FP8 layers that ask for quantized inputs run W8A8 (`fp8_block_activations=
        "fp8"`); a ConfigError where it has none."""
        raise ConfigError(f"invalid fp8_block_activations='fp8': it runs the block-FP8 layers of a checkpoint W8A8, "
                          f"and this model's quantization ({self.name!r}) has none; leave it 'model_dtype'")


def check_layer_kind(scheme: QuantScheme, kind: str, prefix: str) -> None:
    """A ConfigError for a layer kind the scheme has no method for."""
    if kind != LINEAR:
        raise ConfigError(f"invalid quantization: scheme {scheme.name!r} has no method for {kind} layers "
                          f"(layer {prefix!r})")


# name -> scheme class; filled by the scheme modules as they are imported (kestrel.quant imports them all).
SCHEMES: dict[str, type[QuantScheme]] = {}
S = TypeVar("S", bound=type[QuantScheme])


def register_scheme(name: str) -> Callable[[S], S]:
    """Class decorator: register a QuantScheme subclass under `name` (a quant_method or a quantization= name)."""

    def register(cls: S) -> S:
        known = SCHEMES.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"quantization scheme {name!r} is registered twice: {known.__qualname__} and "
                             f"{cls.__qualname__}")
        cls.name = name
        SCHEMES[name] = cls
        return cls

    return register


def registered_schemes() -> list[str]:
    return sorted(SCHEMES)


def scheme_class(name: str | None, where: str, hint: str = "") -> type[QuantScheme]:
    """The class registered as `name`; an unknown name is a ConfigError (`where` says where it came from)
    listing the registered ones."""
    cls = SCHEMES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"invalid {where}={name!r}: no quantization scheme of that name is registered "
                          f"(registered: {registered_schemes()}){hint}")
    return cls


def scheme_from_checkpoint(quantization_config: dict[str, Any]) -> QuantScheme:
    """The scheme of a checkpoint's `quantization_config`, chosen by its `quant_method`."""
    name = quantization_config.get("quant_method")
    at_load = sorted(n for n, cls in SCHEMES.items() if cls.quantizes_at_load)
    hint = f"; quantize the original weights with `kestrel quantize`, or load them with quantization= one of {at_load}"
    return scheme_class(name, "quantization_config.quant_method", hint).from_config(quantization_config)


def scheme_from_flag(config: QuantConfig) -> QuantScheme | None:
    """The scheme of quantization at load (`quantization=`), or None for none."""
    if config.method is None:
        return None
    return scheme_class(config.method, "quantization").from_config(config)
