"""Write a small random Hugging Face checkpoint (config, safetensors, tokenizer) for tests and the demo.

The tensors carry HF names and HF's initializer scale (std 0.02), so the directory loads unchanged
in `transformers.AutoModelForCausalLM` as well as in kestrel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from kestrel.config import EAGLE_HEAD_ARCHITECTURE
from kestrel.init_configs import ARCHS, SIZES
from kestrel.loader.safetensors import INDEX_FILE
from kestrel.loader.tokenizer_init import BOS_TOKEN, EOS_TOKEN, write_tokenizer
from kestrel.model import loading
from kestrel.model.registry import model_skeleton

INIT_STD = 0.02
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def write_tiny_checkpoint(path: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0,
                          num_shards: int = 1, **overrides: Any) -> dict:
    """Write config.json, safetensors weights (`num_shards` > 1 adds an index) and a tokenizer to
    `path`; `overrides` replace config.json entries. Returns the config dict."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = write_tokenizer(str(out))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "hidden_act": "silu",
        **SIZES[size],
        **ARCHS[arch],
        "vocab_size": tokenizer_vocab,
        "max_position_embeddings": 512,
        "initializer_range": INIT_STD,
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    config.update(overrides)
    if config["vocab_size"] < tokenizer_vocab:
        raise ValueError(f"vocab_size={config['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab}")
    dtype = _DTYPES[config["torch_dtype"]]
    tensors = _random_tensors(config, ARCHS[arch]["architectures"][0], seed, dtype)
    _write_weights(out, tensors, num_shards)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    return config


_HEAD_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_act",
              "attention_bias", "mlp_bias", "torch_dtype")


def eagle_head_config(target_config: dict) -> dict:
    """config.json of an EAGLE-style head (kestrel.model.eagle) for a Llama-family target: the target's shapes,
    one decoder layer."""
    config = {key: target_config[key] for key in _HEAD_KEYS if key in target_config}
    return {**config, "architectures": [EAGLE_HEAD_ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "tie_word_embeddings": False}


def eagle_head_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of a head: `fc` over [embedding; feature], one decoder layer, a final norm (no
    embedding or LM head: the target's are shared)."""
    return checkpoint_shapes({**config, "architectures": [EAGLE_HEAD_ARCHITECTURE], "num_hidden_layers": 1})


def write_eagle_head(path: str | Path, target_config: dict, seed: int = 0,
                     tensors: dict[str, torch.Tensor] | None = None) -> dict:
    """Write an EAGLE-style head directory (config.json + model.safetensors) for `target_config`: the given
    tensors, or random ones (HF's initializer scale). Returns the config dict."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = eagle_head_config(target_config)
    if tensors is None:
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, shape in eagle_head_shapes(config).items():
            values = torch.randn(shape, generator=generator) * INIT_STD
            tensors[name] = (values + 1.0 if name.endswith("norm.weight") else values).contiguous()
    _write_weights(out, {name: t.contiguous() for name, t in tensors.items()}, 1)
    _write_json(out / "config.json", config)
    return config


def checkpoint_shapes(config: dict, architecture: str | None = None) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of the model `config` describes (the registered class of `architecture`, default
    the config's, built on the meta device in float32): each module's weight then its bias, modules in the order
    the model declares them."""
    shapes = loading.checkpoint_shapes(model_skeleton(config, architecture))
    by_module: dict[str, list[str]] = {}
    for name in shapes:
        by_module.setdefault(name.rsplit(".", 1)[0], []).append(name)
    return {name: shapes[name] for names in by_module.values() for name in sorted(names, key=_weight_first)}


def _weight_first(name: str) -> tuple[bool, str]:
    return not name.endswith(".weight"), name


def _random_tensors(config: dict, architecture: str, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(config, architecture).items():
        values = torch.randn(shape, generator=generator) * INIT_STD
        if name.endswith("norm.weight"):
            # HF initializes norms to exactly 1; a small spread makes a swapped norm visible in tests.
            values += 1.0
        tensors[name] = values.to(dtype).contiguous()
    return tensors


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    metadata = {"format": "pt"}
    # Leftovers of an earlier write would be picked up by the loader's glob or a stale index.
    for old in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        filename = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::num_shards]}
        save_file(part, str(out / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(part, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
