"""Load a model directory's Hugging Face tokenizer, offline."""

from __future__ import annotations

import os
from typing import Any

from kestrel.config import ConfigError, is_gguf_model
from kestrel.loader.gguf_tokenizer import load_gguf_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer directory's, or a GGUF model's (from its metadata) tokenizer."""
    if is_gguf_model(path):
        return load_gguf_tokenizer(path)
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ConfigError(f"invalid tokenizer={path!r}: the directory has none of {list(_TOKENIZER_FILES)}; "
                          "pass tokenizer=DIR pointing at a Hugging Face tokenizer")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"invalid tokenizer={path!r}: it could not be loaded ({e})") from e
