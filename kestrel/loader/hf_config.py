"""Reading a Hugging Face config.json: the dict itself, the torch dtype, and the KV-cache shape."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kestrel.config import ConfigError, text_decoder_config, validate_hf_config

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def load_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"invalid model={str(model_dir)!r}: no config.json in that directory")
    try:
        hf_config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"invalid model={str(model_dir)!r}: config.json is not valid JSON ({e})") from e
    if isinstance(hf_config, dict):
        hf_config = text_decoder_config(hf_config)
    validate_hf_config(hf_config, f"config.json of model={str(model_dir)!r}")
    return hf_config


def resolve_dtype(dtype: str, hf_config: dict) -> torch.dtype:
    """`dtype` as given by the user; "auto" takes the checkpoint's own (`torch_dtype`, or `dtype` in
    newer configs), float32 when the config names none."""
    if dtype == "auto":
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
        if name not in _DTYPES:
            raise ConfigError(f"invalid dtype='auto': config.json names dtype {name!r}; "
                              f"pass one of {sorted(set(_DTYPES) - {'float', 'half'})} explicitly")
        return _DTYPES[name]
    if dtype not in _DTYPES:
        raise ConfigError(f"invalid dtype={dtype!r}: expected 'auto', 'float32', 'float16' or 'bfloat16'")
    return _DTYPES[dtype]


def get_num_layers(hf_config: dict) -> int:
    return int(hf_config["num_hidden_layers"])


def get_num_kv_heads(hf_config: dict) -> int:
    return int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])


def get_head_dim(hf_config: dict) -> int:
    return int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"])
