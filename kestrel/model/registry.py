"""Hugging Face architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"unsupported model architecture {architecture!r} (config.json `architectures`); "
            f"supported: {', '.join(supported_architectures())}"
        ) from None


def model_skeleton(hf_config: dict) -> nn.Module:
    """The unsharded, unquantized model of `hf_config` on the meta device: its structure and declarations (what
    `kestrel quantize` reads), no weights and no memory."""
    with torch.device("meta"):
        return get_model_class((hf_config.get("architectures") or [""])[0])(hf_config)
