"""A GGUF model's tokenizer and chat template, from its metadata.

transformers builds the vocabulary, merges and normalization from the `tokenizer.ggml.*` keys (`AutoTokenizer` with
`gguf_file`: BPE "gpt2" vocabularies and SentencePiece "llama" ones) and the chat template from
`tokenizer.chat_template`. What its reader gets wrong or leaves out is set here from the same metadata: the special
tokens by id (transformers 5.17 names the BOS token as both BOS and EOS for llama-architecture files), whether BOS /
EOS are added (`tokenizer.ggml.add_bos_token`, else llama.cpp's default: BOS for SentencePiece vocabularies), and
the pre-tokenizer split of Llama 3 vocabularies (`tokenizer.ggml.pre` "llama-bpe": digits in runs of up to three).
"""

from __future__ import annotations

from typing import Any

from kestrel.config import ConfigError
from kestrel.loader.gguf_files import find_gguf

# tokenizer.ggml.pre -> the split regex of its byte-level BPE (Llama 3's, from its tokenizer.json)
PRE_TOKENIZER_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}


def load_gguf_tokenizer(path: str) -> Any:
    model = find_gguf(path)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model.first.parent), gguf_file=model.first.name,
                                                  local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"invalid tokenizer={path!r}: the GGUF file's tokenizer could not be built ({e}); pass "
                          "tokenizer=DIR pointing at the model's Hugging Face tokenizer") from e
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
