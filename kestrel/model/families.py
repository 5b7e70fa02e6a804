"""Decoder families that differ from Llama in their blocks' layout: Phi-3, OLMo 2, GLM-4, Command R and
StarCoder2."""

from __future__ import annotations

from typing import Any, ClassVar

from kestrel.config import ConfigError
from kestrel.model.arch import DecoderArch, LayerNorms, layer_types, windows_of
from kestrel.model.base import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 / 3.5 / 4: Llama with q/k/v and gate/up stored merged (`qkv_proj`, `gate_up_proj`), LongRoPE,
    partial rotary (Phi-4-mini) and a window on every layer when `sliding_window` is set."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        window = hf.get("sliding_window")
        return DecoderArch.from_hf(hf, sliding_windows=(window,) * hf["num_hidden_layers"] if window else ())


class Olmo2ForCausalLM(DecoderForCausalLM):
    """Post-norm (each sublayer's output normalized before its residual add; no input norms) and RMSNorms over
    all heads of q and of k."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(hf, qk_norm=True, qk_norm_over="all_heads",
                                   norms=LayerNorms(None, "post_attention_layernorm", None,
                                                    "post_feedforward_layernorm"))


class Glm4ForCausalLM(DecoderForCausalLM):
    """GLM-4 (0414): sandwich norms, q/k/v bias, interleaved RoPE on half of each head, gate/up stored merged."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(
            hf, qkv_bias=bool(hf.get("attention_bias", True)), o_bias=False, rope_interleaved=True,
            norms=LayerNorms("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                             "post_mlp_layernorm"))


class CohereForCausalLM(DecoderForCausalLM):
    """Command R: attention and MLP in parallel from one bias-free LayerNorm, interleaved RoPE, tied embeddings,
    logits times `logit_scale`."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(hf, **cls._common(hf))

    @classmethod
    def _common(cls, hf: dict[str, Any]) -> dict[str, Any]:
        if hf.get("use_qk_norm"):
            raise ConfigError("unsupported use_qk_norm=true in config.json (Command R+'s per-head LayerNorms); "
                              "kestrel serves Command R configs without it")
        return {"norm": "layer_no_bias", "norm_eps": float(hf.get("layer_norm_eps", 1e-5)), "parallel_block": True,
                "norms": LayerNorms("input_layernorm", None, None, None), "rope_interleaved": True,
                "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
                "logit_scale": float(hf.get("logit_scale", 1.0))}


class Cohere2ForCausalLM(CohereForCausalLM):
    """Command R7B / A: Command R with sliding-window layers (three to one) that alone use RoPE."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        types = layer_types(hf, global_every=4)
        return DecoderArch.from_hf(hf, **cls._common(hf), sliding_windows=windows_of(hf, types),
                                   rope_layers=tuple(t == "sliding_attention" for t in types))


class Starcoder2ForCausalLM(DecoderForCausalLM):
    """StarCoder2: LayerNorms with bias, a plain GELU-tanh MLP (`c_fc`, `c_proj`), bias everywhere when `use_bias`,
    a window on every layer when `sliding_window` is set, tied embeddings."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        bias = bool(hf.get("use_bias", True))
        window = hf.get("sliding_window")
        return DecoderArch.from_hf(hf, norm="layer", norm_eps=float(hf.get("norm_epsilon", 1e-5)),
                                   plain_mlp=("c_fc", "c_proj"), qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                                   sliding_windows=(window,) * hf["num_hidden_layers"] if window else ())
