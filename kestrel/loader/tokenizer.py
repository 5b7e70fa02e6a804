"""Load a model directory's Hugging Face tokenizer, offline."""

from __future__ import annotations

import json
import os
from typing import Any

from kestrel.config import ConfigError, is_gguf_model
from kestrel.loader.gguf_tokenizer import load_gguf_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# Class names under which AutoTokenizer loads the generic fast tokenizer from tokenizer.json (Llama 3's and
# kestrel-tiny's, among others): loaded through that class directly, which spares importing AutoTokenizer's
# registry of every model family (about 3 s of a process's start; the result is the same object).
GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer directory's, or a GGUF model's (from its metadata) tokenizer."""
    if is_gguf_model(path):
        return load_gguf_tokenizer(path)
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ConfigError(f"invalid tokenizer={path!r}: the directory has none of {list(_TOKENIZER_FILES)}; "
                          "pass tokenizer=DIR pointing at a Hugging Face tokenizer")
    try:
        if _generic_fast(path):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # the tokenizers library raises bare Exceptions for a malformed tokenizer.json
        raise ConfigError(f"invalid tokenizer={path!r}: it could not be loaded ({e})") from e


def tokenizer_modules(path: str) -> tuple[str, ...]:
    """The modules `load_tokenizer(path)` imports, for a process that imports them before it forks its
    tokenizer workers."""
    if _generic_fast(path):  # never a GGUF file: it has no tokenizer_config.json beside it
        return ("kestrel.loader.tokenizer", "transformers.tokenization_utils_tokenizers")
    return ("kestrel.loader.tokenizer", "transformers.models.auto.tokenization_auto")


def _generic_fast(path: str) -> bool:
    """Whether AutoTokenizer would build the generic fast tokenizer here: tokenizer_config.json names one of
    GENERIC_FAST_CLASSES, tokenizer.json is present, and no auto_map points at remote code."""
    config_file = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(config_file) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return False
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False  # AutoTokenizer reports what is wrong with it
    return (isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_FAST_CLASSES
            and "auto_map" not in config)
