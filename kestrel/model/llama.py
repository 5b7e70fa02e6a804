"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3 and Granite share the pre-norm decoder; they differ only in
config reading. Llama, Qwen2 and Qwen3 also come as sequence classifiers (cross-encoders, reward models)."""

from __future__ import annotations

from typing import Any

from kestrel.model.arch import DecoderArch, layer_types
from kestrel.model.base import DecoderForCausalLM, SequenceClassifier


class LlamaForCausalLM(DecoderForCausalLM):
    """`forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden]`;
    `compute_logits(hidden [R, hidden]) -> float32 logits [R, vocab]`."""


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window on every layer."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        window = hf.get("sliding_window")
        return DecoderArch.from_hf(hf, sliding_windows=(window,) * hf["num_hidden_layers"])


def qwen_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen's sliding windows: only where `use_sliding_window` asks, on the layers `layer_types` names or else on
    those from `max_window_layers` on."""
    num_layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if hf.get("layer_types") is not None:
        types = layer_types(hf)
    else:
        first_windowed = hf.get("max_window_layers", num_layers)
        types = ["sliding_attention" if window is not None and i >= first_windowed else "full_attention"
                 for i in range(num_layers)]
    return tuple(window if t == "sliding_attention" else None for t in types)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v bias (no o_proj bias)."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(hf, qkv_bias=True, o_bias=False, sliding_windows=qwen_windows(hf))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head q/k RMSNorm (and `attention_bias` for q/k/v/o)."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(hf, qk_norm=True, sliding_windows=qwen_windows(hf))


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama with multipliers: embeddings, attention scores, each residual branch, and logits (divided)."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(hf, embedding_scale=float(hf.get("embedding_multiplier", 1.0)),
                                   attention_scale=float(hf.get("attention_multiplier", 1.0)),
                                   residual_scale=float(hf.get("residual_multiplier", 1.0)),
                                   logit_scale=1.0 / float(hf.get("logits_scaling", 1.0)))


class LlamaForSequenceClassification(SequenceClassifier, LlamaForCausalLM):
    """Llama with a `score` head over the last token."""


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2ForCausalLM):
    """Qwen2 with a `score` head over the last token."""


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3ForCausalLM):
    """Qwen3 with a `score` head over the last token (Qwen3-Reranker-style cross-encoders converted to one)."""
