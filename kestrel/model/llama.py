"""The Llama family: Llama 2/3, Mistral and Qwen2 share the pre-norm decoder; they differ only in config reading."""

from __future__ import annotations

from typing import Any

from kestrel.model.arch import DecoderArch
from kestrel.model.base import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """`forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden]`;
    `compute_logits(hidden [R, hidden]) -> float32 logits [R, vocab]`."""


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window on every layer."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        window = hf.get("sliding_window")
        return DecoderArch.from_hf(hf, sliding_windows=(window,) * hf["num_hidden_layers"])


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v bias (no o_proj bias); sliding window only where `use_sliding_window` asks."""

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> DecoderArch:
        num_layers = hf["num_hidden_layers"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first_windowed = hf.get("max_window_layers", num_layers)
            layer_types = ["sliding_attention" if window is not None and i >= first_windowed else "full_attention"
                           for i in range(num_layers)]
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        return DecoderArch.from_hf(hf, qkv_bias=True, o_bias=False, sliding_windows=windows)
