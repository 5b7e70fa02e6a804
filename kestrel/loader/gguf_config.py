"""A GGUF model's Hugging Face-style config, from its metadata: transformers' GGUF reader (`AutoConfig` with
`gguf_file`) gives the shapes and RoPE base; kestrel adds the architecture class, the default dtype, Llama 3.1's RoPE
factors (the `rope_freqs` tensor), and the `quantization_config` of the modules the weight-only kernel can run as
stored (`kestrel.quant.schemes.gguf`).

The default dtype ("auto") is float32 for a file of float32 tensors only, bfloat16 when it has BF16 tensors, else
float16 when it has F16 ones, else (a quantized file) bfloat16.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kestrel.config import ConfigError, is_gguf_model
from kestrel.loader.gguf_files import GGUFModel, find_gguf
from kestrel.loader.gguf_weights import ROPE_FREQS, check_architecture, check_tensor_types, dequantize, hf_names
from kestrel.quant.gguf_blocks import FORMS


def model_hf_config(model: str) -> dict | None:
    """The config of a GGUF model path, or None for any other model (whose config.json the engine reads)."""
    return gguf_hf_config(find_gguf(model)) if is_gguf_model(model) else None


def gguf_hf_config(model: GGUFModel) -> dict[str, Any]:
    architecture = check_architecture(model.field("general.architecture"))
    check_tensor_types(model)
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(model.first.parent), gguf_file=model.first.name,
                                            local_files_only=True).to_dict()
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"invalid model {model.first}: its GGUF metadata does not make a config ({e})") from e
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    # transformers reads no head size for some architectures and falls back to its config class's default (128
    # for Qwen3); llama.cpp writes it as the key length when it is not hidden_size / heads.
    key_length = model.field(f"{architecture}.attention.key_length")
    config["head_dim"] = int(key_length) if key_length else config["hidden_size"] // config["num_attention_heads"]
    config["torch_dtype"] = _default_dtype(model)
    rope_freqs = next((t for t in model.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        config["rope_parameters"] = _rope_with_factors(config, dequantize(rope_freqs).float().numpy())
    types = {tensor.name: tensor.tensor_type.name for tensor in model.tensors}
    modules = {name.removesuffix(".weight"): types[gguf_name] for gguf_name, name in hf_names(model, config).items()
               if name.endswith(".weight") and types[gguf_name] in FORMS}
    if modules:
        config["quantization_config"] = {"quant_method": "gguf", "modules": modules}
    return config


def _default_dtype(model: GGUFModel) -> str:
    types = {tensor.tensor_type.name for tensor in model.tensors}
    if types == {"F32"}:
        return "float32"
    if "BF16" in types:
        return "bfloat16"
    return "float16" if "F16" in types else "bfloat16"


def _rope_with_factors(config: dict[str, Any], factors: np.ndarray) -> dict[str, Any]:
    """llama.cpp divides each RoPE frequency by its `rope_freqs` entry (Llama 3.1's scaling, precomputed by its
    converter); LongRoPE with equal short and long factors and no attention scaling computes exactly that."""
    params = dict(config.get("rope_parameters") or {})
    if params.get("rope_type", "default") != "default":
        raise ConfigError(f"invalid model: the GGUF file has {ROPE_FREQS} and RoPE scaling {params['rope_type']!r}; "
                          "kestrel reads one or the other")
    listed = [float(f) for f in factors.reshape(-1)]
    return {**params, "rope_type": "longrope", "short_factor": listed, "long_factor": listed,
            "original_max_position_embeddings": int(config["max_position_embeddings"]), "attention_factor": 1.0}
