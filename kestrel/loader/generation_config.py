"""A model's generation_config.json as the engine applies it: its EOS ids end generation besides the tokenizer's,
and its sampling settings are the defaults of requests that do not set them (vLLM's `--generation-config auto`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kestrel.config import ConfigError, ModelConfig

# generation_config.json keys -> SamplingParams fields (the ones a model's defaults may set).
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty"}


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: frozenset[int] = frozenset()
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value


def load_generation_defaults(config: ModelConfig) -> GenerationDefaults:
    path = config.generation_config_path
    if path is None:
        return GenerationDefaults()
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"invalid generation_config={config.generation_config!r}: {path} could not be read ({e}); "
                          "fix it or pass generation_config='vllm' to ignore it") from None
    eos = data.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(t, int) and t >= 0 for t in eos_ids):
        raise ConfigError(f"invalid generation_config: eos_token_id={eos!r} in {path} is not a token id or a list "
                          "of them")
    sampling = {ours: data[key] for key, ours in SAMPLING_KEYS.items() if data.get(key) is not None}
    return GenerationDefaults(frozenset(eos_ids), sampling)
