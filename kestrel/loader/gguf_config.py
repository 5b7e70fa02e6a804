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

    try:
        config = AutoConfig.for_model(**_config_fields(model, architecture)).to_dict()
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"invalid model {model.first}: its GGUF metadata does not make a config ({e})") from e
    config["architectures"] = [MODEL_CLASSES[config["model_type"]]]
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


# llama.cpp's metadata keys (after the architecture's prefix) -> the config fields transformers' GGUF reader gives
# them, for the architectures kestrel loads; the config class supplies every other field's default, as there.
CONFIG_FIELDS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                 "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                 "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
                 "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
                 "vocab_size": "vocab_size"}
# ... and the tokenizer's ids, which that reader also puts in the config.
TOKEN_ID_FIELDS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
                   "tokenizer.ggml.unknown_token_id": "unk_token_id", "tokenizer.ggml.padding_token_id": "pad_token_id"}
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def _config_fields(model: GGUFModel, architecture: str) -> dict[str, Any]:
    """The config's model type and fields from the metadata, read as transformers' GGUF reader reads them (a Llama
    file whose general.name is "mistral" is a Mistral model; the LM head tied where the file has no output tensor;
    the vocabulary from the token list where the metadata gives no size), without its second parse of the file."""
    fields = {hf: model.field(f"{architecture}.{key}") for key, hf in CONFIG_FIELDS.items()}
    fields.update({hf: model.field(key) for key, hf in TOKEN_ID_FIELDS.items()})
    fields = {name: value for name, value in fields.items() if value is not None}
    fields["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in model.tensors)
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(model.field("tokenizer.ggml.tokens") or [])
    mistral = architecture == "llama" and model.field("general.name") == "mistral"
    return {"model_type": "mistral" if mistral else architecture, **fields}


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
