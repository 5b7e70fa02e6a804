"""`quant_method: "gptq"` checkpoints (AutoGPTQ, GPTQModel, transformers/optimum): 4- or 8-bit weights packed
along the input features (`qweight`), per-group or per-channel scales, symmetric or with packed zero points
(`qzeros`, v1 format storing zero - 1 unless `checkpoint_format` is "gptq_v2"), optional act-order (`desc_act`,
`g_idx`; with `static_groups` the groups stay contiguous and nothing is reordered), run as weight-only layers
(`kestrel.quant.wna16`).

Every linear layer of the decoder is quantized except those `modules_in_block_to_quantize` leaves out (its
lists name modules within a block, e.g. "self_attn.q_proj") and those a `dynamic` rule excludes ("-:" + a
regular expression matched at the start of the module name); a positive `dynamic` rule ("+:" or a bare regular
expression) overrides `bits`, `group_size`, `sym` or `desc_act` of the modules it matches. Refused with a
ConfigError naming the setting: 2- and 3-bit weights, group sizes the kernel cannot run, other storage formats
(`checkpoint_format` marlin, bitblas, ...; `is_marlin_format`; `pack_dtype` other than int32), a quantized LM
head (`lm_head: true`), and mixture-of-experts experts (no weight-only MoE kernel yet).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.scheme import LayerKind, QuantScheme, check_layer_kind, register_scheme
from kestrel.quant.wna16 import GROUP_MULTIPLE, WNA16LinearMethod, WNA16Spec, one_spec

_FORMATS = {"gptq": True, "gptq_v2": False}  # checkpoint_format -> qzeros store zero - 1
_OVERRIDABLE = ("bits", "group_size", "sym", "desc_act")
_WHERE = "quant_method='gptq'"


@register_scheme("gptq")
class GPTQScheme(QuantScheme):
    loads_checkpoints = True
    prequantized = True

    def __init__(self, settings: dict[str, Any], zeros_minus_one: bool, block_modules: tuple[str, ...] | None,
                 dynamic: Sequence[tuple[str, bool, dict[str, Any]]], lm_head: bool,
                 static_groups: bool = False) -> None:
        self.settings = settings  # bits, group_size, sym, desc_act
        self.zeros_minus_one = zeros_minus_one
        self.block_modules = block_modules  # None: every linear module of a block
        self.dynamic = tuple(dynamic)  # (pattern, quantized, overrides), first match wins
        self.lm_head = lm_head
        self.static_groups = static_groups

    @classmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> GPTQScheme:
        if isinstance(config, QuantConfig):
            raise ConfigError("invalid quantization='gptq': it names a checkpoint format, which needs a checkpoint "
                              "with a GPTQ quantization_config")
        if config.get("is_marlin_format"):
            raise ConfigError(f"invalid quantization_config.is_marlin_format=True ({_WHERE}): Marlin-repacked "
                              "GPTQ checkpoints are not supported; the plain GPTQ format (checkpoint_format 'gptq' "
                              "or 'gptq_v2') loads")
        fmt = config.get("checkpoint_format") or "gptq"
        if fmt not in _FORMATS:
            raise ConfigError(f"invalid quantization_config.checkpoint_format={fmt!r} ({_WHERE}): expected one of "
                              f"{list(_FORMATS)}")
        pack_dtype = config.get("pack_dtype", "int32")
        if pack_dtype not in ("int32", "torch.int32"):
            raise ConfigError(f"invalid quantization_config.pack_dtype={pack_dtype!r} ({_WHERE}): GPTQ weights packed "
                              "in int32 words load")
        settings = {"bits": config.get("bits"), "group_size": config.get("group_size"),
                    "sym": config.get("sym", True), "desc_act": config.get("desc_act", False)}
        _check_settings(settings, "")
        # desc_act with static_groups keeps every group a contiguous run of input features (g_idx = k // group): no
        # reordering at run time, and row-parallel layers split like any other (the g_idx is still checked).
        static_groups = config.get("static_groups", False) is True
        blocks = config.get("modules_in_block_to_quantize")
        block_modules = None
        if blocks is not None:
            block_modules = tuple(name for entry in blocks
                                  for name in (entry if isinstance(entry, (list, tuple)) else [entry]))
        dynamic = []
        for key, overrides in (config.get("dynamic") or {}).items():
            quantized = not key.startswith("-:")
            pattern = key[2:] if key.startswith(("-:", "+:")) else key
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"invalid quantization_config.dynamic key {key!r} ({_WHERE}): not a regular "
                                  f"expression ({e})") from None
            overrides = dict(overrides or {}) if quantized else {}
            unknown = sorted(set(overrides) - set(_OVERRIDABLE))
            if unknown:
                raise ConfigError(f"invalid quantization_config.dynamic[{key!r}] ({_WHERE}): overrides {unknown} "
                                  f"are not supported; a rule may set {list(_OVERRIDABLE)} or exclude modules "
                                  "('-:' prefix)")
            _check_settings({**settings, **overrides}, f"dynamic[{key!r}].")
            dynamic.append((pattern, quantized, overrides))
        return cls(settings, _FORMATS[fmt], block_modules, dynamic, bool(config.get("lm_head", False)), static_groups)

    @property
    def precision(self) -> str:
        return f"w{self.settings['bits']}a16"

    def spec_for(self, module_name: str) -> WNA16Spec | None:
        """The spec of a checkpoint linear module, or None when it stays unquantized."""
        if self.block_modules is not None and not any(
                module_name == name or module_name.endswith("." + name) for name in self.block_modules):
            return None
        settings = self.settings
        for pattern, quantized, overrides in self.dynamic:
            if re.match(pattern, module_name):
                if not quantized:
                    return None
                settings = {**settings, **overrides}
                break
        # Per channel (one group) or with static groups, every group is a contiguous run whatever desc_act says.
        act_order = settings["desc_act"] and settings["group_size"] > 0 and not self.static_groups
        return WNA16Spec("gptq", settings["bits"], settings["group_size"], settings["sym"], act_order,
                         zeros_minus_one=self.zeros_minus_one, source=_WHERE,
                         group_field="quantization_config.group_size", act_order_field="desc_act=True")

    def get_quant_method(self, kind: LayerKind, prefix: str,
                         parts: Sequence[str] = ()) -> QuantMethod | FusedMoEMethod | None:
        check_layer_kind(self, kind, prefix)
        spec = one_spec(prefix, parts, self.spec_for, self.name)
        return None if spec is None else WNA16LinearMethod(spec, prefix)

    def check_unquantized(self, module_name: str) -> None:
        if module_name == "lm_head" and self.lm_head:
            raise ConfigError(f"invalid quantization_config.lm_head=True ({_WHERE}): the checkpoint quantizes "
                              "'lm_head', which kestrel runs in the model dtype")


def _check_settings(settings: dict[str, Any], prefix: str) -> None:
    bits, group = settings["bits"], settings["group_size"]
    if bits not in (4, 8):
        raise ConfigError(f"invalid quantization_config.{prefix}bits={bits!r} ({_WHERE}): 4- and 8-bit weights "
                          "load (W4A16 / W8A16)")
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise ConfigError(f"invalid quantization_config.{prefix}group_size={group!r} ({_WHERE}): expected a "
                          "positive group size or -1 (per channel)")
    if group > 0 and group % GROUP_MULTIPLE:
        raise ConfigError(f"invalid quantization_config.{prefix}group_size={group} ({_WHERE}): the weight-only "
                          f"kernel runs groups that are multiples of {GROUP_MULTIPLE}")
    for name in ("sym", "desc_act"):
        if not isinstance(settings[name], bool):
            raise ConfigError(f"invalid quantization_config.{prefix}{name}={settings[name]!r} ({_WHERE}): expected "
                              "true or false")
