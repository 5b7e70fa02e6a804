"""Gemma, Gemma 2 and Gemma 3 (text): GELU-tanh gated MLP, `(1 + weight)` RMSNorms, embeddings times
sqrt(hidden); Gemma 2 adds the sandwich norms, attention and final logit soft-capping and alternating sliding
windows; Gemma 3 adds q/k norms and a local RoPE base on its sliding layers (five local to one global). Gemma 3 with
images is `kestrel.model.gemma3_vl`."""

from __future__ import annotations

from typing import Any, ClassVar

from kestrel.config import ConfigError
from kestrel.model.arch import SANDWICH_NORMS, DecoderArch, layer_types, windows_of
from kestrel.model.base import DecoderForCausalLM
from kestrel.model.layers.activation import activation_from_hf
from kestrel.model.layers.rotary import RopeConfig


def _gemma_arch(hf: dict[str, Any], **family: Any) -> DecoderArch:
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("unsupported use_bidirectional_attention=true in config.json: kestrel serves causal "
                          "decoders only")
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return DecoderArch.from_hf(hf, activation=activation_from_hf(activation), norm="rms_unit_offset",
                               embedding_scale=hf["hidden_size"] ** 0.5,
                               tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), **family)


class GemmaForCausalLM(DecoderForCausalLM):
    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return _gemma_arch(hf)


class Gemma2ForCausalLM(DecoderForCausalLM):
    _GLOBAL_EVERY: ClassVar[int] = 2

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return _gemma_arch(hf, **cls._attention(hf), logit_soft_cap=hf.get("attn_logit_softcapping"),
                           final_logit_soft_cap=hf.get("final_logit_softcapping"))

    @classmethod
    def _attention(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {"norms": SANDWICH_NORMS, "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                "sliding_windows": windows_of(hf, layer_types(hf, cls._GLOBAL_EVERY))}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    _GLOBAL_EVERY: ClassVar[int] = 6

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        per_type = hf.get("rope_parameters") or {}
        if "full_attention" in per_type:
            length = {"max_position_embeddings": hf.get("max_position_embeddings")}
            rope = RopeConfig.from_hf({**length, "rope_parameters": per_type["full_attention"]})
            local = RopeConfig.from_hf({**length, "rope_parameters": per_type.get("sliding_attention") or {}})
        else:  # transformers 4's names
            rope = RopeConfig.from_hf({"rope_theta": 1_000_000.0, **hf})
            local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))
        return _gemma_arch(hf, **cls._attention(hf), qk_norm=True, rope=rope, rope_local=local,
                           logit_soft_cap=hf.get("attn_logit_softcapping"),
                           final_logit_soft_cap=hf.get("final_logit_softcapping"))

