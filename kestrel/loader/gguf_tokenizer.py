"""A GGUF model's tokenizer and chat template, from its metadata.

transformers' GGUF converters build the vocabulary, merges and normalization from the `tokenizer.ggml.*` keys (BPE
"gpt2" vocabularies and SentencePiece "llama" ones), given the metadata as kestrel's reader has it
(`loader/gguf_reader.py`): `AutoTokenizer` with `gguf_file` builds the same tokenizer but parses the whole file twice
with `gguf.GGUFReader` first, 20 s of start-up for a 128k-token vocabulary on a small CPU. The chat template
comes from `tokenizer.chat_template`. What the converters get wrong or leave out is set here from the same metadata:
the special tokens by id (transformers 5.17 names the BOS token as both BOS and EOS for llama-architecture files),
whether BOS / EOS are added (`tokenizer.ggml.add_bos_token`, else llama.cpp's default: BOS for SentencePiece
vocabularies), and the pre-tokenizer split of Llama 3 vocabularies (`tokenizer.ggml.pre` "llama-bpe": digits in
runs of up to three).
"""

from __future__ import annotations

from typing import Any

from kestrel.config import ConfigError
from kestrel.loader.gguf_files import GGUFModel, find_gguf

# tokenizer.ggml.pre -> the split regex of its byte-level BPE (Llama 3's, from its tokenizer.json)
PRE_TOKENIZER_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}


def load_gguf_tokenizer(path: str) -> Any:
    model = find_gguf(path)
    try:
        tokenizer = _converted(model)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"invalid tokenizer={path!r}: the GGUF file's tokenizer could not be built ({e}); pass "
                          "tokenizer=DIR pointing at the model's Hugging Face tokenizer") from e
    return adjusted_to_metadata(tokenizer, model)


def adjusted_to_metadata(tokenizer: Any, model: GGUFModel) -> Any:
    """`tokenizer` (as transformers' converters build it) with what they get wrong or leave out set from the
    metadata: the special tokens by id, BOS / EOS added or not, Llama 3's pre-tokenizer split."""
    tokens = model.field("tokenizer.ggml.tokens")
    for attribute, key in _SPECIAL.items():
        token_id = model.field(f"tokenizer.ggml.{key}")
        if token_id is not None:
            setattr(tokenizer, attribute, tokens[int(token_id)])
    split = PRE_TOKENIZER_SPLITS.get(model.field("tokenizer.ggml.pre"))
    if split is not None:
        from tokenizers import Regex, pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    sentencepiece = model.field("tokenizer.ggml.model") == "llama"
    tokenizer.add_eos_token = bool(model.field("tokenizer.ggml.add_eos_token", False))
    tokenizer.add_bos_token = bool(model.field("tokenizer.ggml.add_bos_token", sentencepiece))
    return tokenizer


def _converted(model: GGUFModel) -> Any:
    """The tokenizer transformers' `AutoTokenizer.from_pretrained(..., gguf_file=...)` builds for this file: its
    converter for the file's architecture over the `tokenizer.*` keys under transformers' names, in the tokenizer
    class transformers registers for the model type, with the chat template and the special token ids as its
    tokenizer config and its default BOS / EOS strings."""
    from transformers import TokenizersBackend
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    sections = {section: {name: value for key, name in renames.items()
                          if (value := model.field(f"tokenizer.{key}")) is not None}
                for section, renames in GGUF_TOKENIZER_MAPPING.items()}
    architecture = model.field("general.architecture")
    backend, extra = convert_gguf_tokenizer(architecture, sections["tokenizer"])
    registered = TOKENIZER_MAPPING_NAMES.get(architecture)
    tokenizer_class = (tokenizer_class_from_name(registered) if registered else None) or TokenizersBackend
    # The generic class names "<s>" / "</s>" its BOS / EOS unless told (a class of its own builds its tokenizer first
    # and does not).
    defaults = {"bos_token": "<s>", "eos_token": "</s>"} if tokenizer_class is TokenizersBackend else {}
    return tokenizer_class(tokenizer_object=backend, **{**defaults, **sections["tokenizer_config"], **extra})
