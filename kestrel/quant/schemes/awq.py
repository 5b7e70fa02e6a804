"""`quant_method: "awq"` checkpoints in the GEMM layout (AutoAWQ's `version: "gemm"`, transformers' AwqConfig):
4-bit weights and zero points packed along the output features in AWQ's interleaved order (`qweight [K, N / 8]`,
`qzeros [G, N / 8]`), fp16 `scales [G, N]`, run as weight-only layers (`kestrel.quant.wna16`).

Every linear layer of the decoder is quantized except the modules `modules_to_not_convert` names (a name
contained in the module's, as AutoAWQ and vLLM match). Refused with a ConfigError naming the setting: other
layouts (`version` gemv, gemv_fast, marlin, exllama, ipex), bit widths other than 4, `zero_point: false`, group
sizes the kernel cannot run, and mixture-of-experts experts (no weight-only MoE kernel yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kestrel.config import ConfigError, QuantConfig
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.scheme import LayerKind, QuantScheme, check_layer_kind, register_scheme
from kestrel.quant.wna16 import GROUP_MULTIPLE, WNA16LinearMethod, WNA16Spec, one_spec

_WHERE = "quant_method='awq'"
DEFAULT_GROUP_SIZE = 128  # AutoAWQ's and transformers' default


@register_scheme("awq")
class AWQScheme(QuantScheme):
    loads_checkpoints = True
    prequantized = True

    def __init__(self, group_size: int, skip: tuple[str, ...]) -> None:
        self.spec = WNA16Spec("awq", 4, group_size, symmetric=False, act_order=False, source=_WHERE,
                              group_field="quantization_config.group_size")
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any] | QuantConfig) -> AWQScheme:
        if isinstance(config, QuantConfig):
            raise ConfigError("invalid quantization='awq': it names a checkpoint format, which needs a checkpoint "
                              "with an AWQ quantization_config")
        version = str(config.get("version") or "gemm").lower()
        if version != "gemm":
            raise ConfigError(f"invalid quantization_config.version={config.get('version')!r} ({_WHERE}): only the "
                              "GEMM layout ('gemm') loads; GEMV, GEMV-fast, Marlin, ExLlama and IPEX layouts do not")
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise ConfigError(f"invalid quantization_config.bits={bits!r} ({_WHERE}): AWQ GEMM checkpoints load with "
                              "4-bit weights")
        zero_point = config.get("zero_point", True)
        if zero_point is not True:
            raise ConfigError(f"invalid quantization_config.zero_point={zero_point!r} ({_WHERE}): AWQ GEMM "
                              "checkpoints load with zero points (zero_point: true)")
        group = config.get("group_size", config.get("q_group_size", DEFAULT_GROUP_SIZE))
        if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
            raise ConfigError(f"invalid quantization_config.group_size={group!r} ({_WHERE}): expected a positive "
                              "group size or -1 (per channel)")
        if group > 0 and group % GROUP_MULTIPLE:
            raise ConfigError(f"invalid quantization_config.group_size={group} ({_WHERE}): the weight-only kernel "
                              f"runs groups that are multiples of {GROUP_MULTIPLE}")
        return cls(group, tuple(config.get("modules_to_not_convert") or ()))

    @property
    def precision(self) -> str:
        return "w4a16"

    def spec_for(self, module_name: str) -> WNA16Spec | None:
        return None if any(name in module_name for name in self.skip) else self.spec

    def get_quant_method(self, kind: LayerKind, prefix: str,
                         parts: Sequence[str] = ()) -> QuantMethod | FusedMoEMethod | None:
        check_layer_kind(self, kind, prefix)
        spec = one_spec(prefix, parts, self.spec_for, self.name)
        return None if spec is None else WNA16LinearMethod(spec, prefix)
