"""Hugging Face architecture name (config.json `architectures[0]`) -> model class, imported on first use.

A family registers here by name and module path; nothing outside `kestrel.model` imports a family module.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from kestrel.config import EAGLE_HEAD_ARCHITECTURE, ConfigError

# architecture -> "module:Class"
_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "kestrel.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kestrel.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "kestrel.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "kestrel.model.llama:Qwen3ForCausalLM",
    "LlamaForSequenceClassification": "kestrel.model.llama:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "kestrel.model.llama:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": "kestrel.model.llama:Qwen3ForSequenceClassification",
    "GraniteForCausalLM": "kestrel.model.llama:GraniteForCausalLM",
    "GemmaForCausalLM": "kestrel.model.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "kestrel.model.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "kestrel.model.gemma:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "kestrel.model.gemma3_vl:Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM": "kestrel.model.families:Phi3ForCausalLM",
    "Olmo2ForCausalLM": "kestrel.model.families:Olmo2ForCausalLM",
    "Glm4ForCausalLM": "kestrel.model.families:Glm4ForCausalLM",
    "CohereForCausalLM": "kestrel.model.families:CohereForCausalLM",
    "Cohere2ForCausalLM": "kestrel.model.families:Cohere2ForCausalLM",
    "Starcoder2ForCausalLM": "kestrel.model.families:Starcoder2ForCausalLM",
    "MixtralForCausalLM": "kestrel.model.moe:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "kestrel.model.moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "kestrel.model.moe:Qwen3MoeForCausalLM",
    "OlmoeForCausalLM": "kestrel.model.moe:OlmoeForCausalLM",
    "LlavaForConditionalGeneration": "kestrel.model.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "kestrel.model.llava_next:LlavaNextForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "kestrel.model.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "kestrel.model.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration": "kestrel.model.qwen2_audio:Qwen2AudioForConditionalGeneration",
    "WhisperForConditionalGeneration": "kestrel.model.whisper:WhisperForConditionalGeneration",
}
# Draft heads: loaded beside a target model, never served on their own.
_DRAFT_HEADS: dict[str, str] = {EAGLE_HEAD_ARCHITECTURE: "kestrel.model.eagle:EagleHead"}
_registered: dict[str, type[nn.Module]] = {}


def register_model(architecture: str, model_cls: type[nn.Module]) -> None:
    """Serve `architecture` with `model_cls` (a family defined outside this package, or a test's)."""
    _registered[architecture] = model_cls


def supported_architectures() -> list[str]:
    return sorted({*_FAMILIES, *_registered})


def _import(path: str) -> type[nn.Module]:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture in _registered:
        return _registered[architecture]
    path = _FAMILIES.get(architecture)
    if path is None:
        raise ConfigError(
            f"unsupported model architecture {architecture!r} (config.json `architectures`); "
            f"supported: {', '.join(supported_architectures())}"
        )
    return _import(path)


def get_draft_head_class(architecture: str) -> type[nn.Module]:
    path = _DRAFT_HEADS.get(architecture)
    if path is None:
        raise ConfigError(f"unsupported draft head architecture {architecture!r} (config.json `architectures`); "
                          f"supported: {', '.join(sorted(_DRAFT_HEADS))}")
    return _import(path)


def model_skeleton(hf_config: dict, architecture: str | None = None) -> nn.Module:
    """The unsharded, unquantized float32 model (or draft head) of `hf_config` as `architecture` (default: the
    config's) on the meta device: its structure and declarations (what `kestrel quantize` and the checkpoint
    writer read), no weights and no memory."""
    architecture = architecture or (hf_config.get("architectures") or [""])[0]
    model_cls = get_draft_head_class(architecture) if architecture in _DRAFT_HEADS else get_model_class(architecture)
    with torch.device("meta"):
        return model_cls(hf_config, torch.float32)
