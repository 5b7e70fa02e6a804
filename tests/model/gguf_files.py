"""Tiny GGUF files written with gguf's own writer, for the GGUF tests: a random model of a kestrel tiny checkpoint's
config and tokenizer, stored in llama.cpp's names and layout (q/k rows permuted for Llama, as llama.cpp's converter
does) in the GGML types asked for, and the float weights that file holds by gguf's own dequantizer (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

# llama.cpp's names, written out here rather than taken from gguf's table (the loader uses that one).
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Random K-quant blocks: (block bytes, offsets of the fp16 super-block scales d / dmin, their values).
_K_BLOCKS = {"Q4_K": (144, {0: 2e-4, 2: 1e-4}), "Q5_K": (176, {0: 1e-4, 2: 1e-4}), "Q6_K": (210, {208: 2e-5})}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: within each head, rows (s * D / 2 + j) -> (2 j + s)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(config: dict, hf_name: str) -> int | None:
    if config["model_type"] != "llama":
        return None
    if ".q_proj." in hf_name:
        return config["num_attention_heads"]
    if ".k_proj." in hf_name:
        return config["num_key_value_heads"]
    return None


def _encode(values: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    if type_name in _K_BLOCKS:
        size, scales = _K_BLOCKS[type_name]
        rows, cols = values.shape
        blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        for offset, scale in scales.items():
            blocks[..., offset:offset + 2] = np.float16(scale).reshape(1).view(np.uint8)
        return blocks.reshape(rows, -1), qtype
    if type_name == "IQ4_NL":  # a type kestrel refuses: bytes of the right size are enough
        return rng.integers(0, 256, (values.shape[0], values.shape[1] // 32 * 18), dtype=np.uint8), qtype
    return gguf.quants.quantize(values.astype(np.float32), qtype), qtype


def write_gguf(path: Path, hf_dir: Path, types: dict[str, str], *, seed: int = 0, split_max_tensors: int = 0,
               architecture: str | None = None, pre: str = "gpt-2") -> Path:
    """A GGUF file at `path` with `hf_dir`'s config and tokenizer and random weights: 2-D tensors in the type
    `types` gives their GGUF name's module ("attn_v", "output", ...) or else `types["default"]`, norms in F32."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = architecture or config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    _add_tokenizer(writer, hf_dir, pre)
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    rng = np.random.default_rng(seed)
    for hf_name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        name = gguf_name(hf_name)
        if tensor.dim() == 1 and "norm" in name:
            values = 1.0 + 0.2 * rng.standard_normal(tensor.shape)
        else:
            values = 0.08 * rng.standard_normal(tensor.shape)
        heads = _heads(config, hf_name)
        if heads is not None:
            values = _llama_permute(values, heads)
        module = name.split(".")[-2]
        type_name = "F32" if tensor.dim() == 1 else types.get(module, types["default"])
        data, qtype = _encode(values.astype(np.float32), type_name, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama3_rope_factors(config: dict) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3.1's RoPE scaling: each frequency's divisor."""
    scaling = config["rope_scaling"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, pre: str) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    chat_template = json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {added["id"] for added in tok["added_tokens"] if added["special"]}
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    config = json.loads((hf_dir / "config.json").read_text())
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(chat_template)


def oracle_state_dict(paths: list[Path], config: dict) -> dict[str, torch.Tensor]:
    """HF name -> float32 weight of what the GGUF files hold, by gguf's own dequantizer (q/k rows put back)."""
    by_gguf = {}
    for hf_name in _all_hf_names(config):
        by_gguf[gguf_name(hf_name)] = hf_name
    state = {}
    for path in paths:
        for tensor in gguf.GGUFReader(str(path)).tensors:
            if tensor.name == "rope_freqs.weight":  # the config's rope_scaling, for transformers
                continue
            hf_name = by_gguf[tensor.name]
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            heads = _heads(config, hf_name)
            if heads is not None:
                order = _llama_permute(np.arange(values.shape[0]), heads)
                restored = np.empty_like(values)
                restored[order] = values
                values = restored
            state[hf_name] = torch.from_numpy(values.copy())
    return state


def _all_hf_names(config: dict) -> list[str]:
    names = list(_GLOBAL)
    for layer in range(config["num_hidden_layers"]):
        for module in _LAYER:
            names += [f"model.layers.{layer}.{module}.weight", f"model.layers.{layer}.{module}.bias"]
    return names
