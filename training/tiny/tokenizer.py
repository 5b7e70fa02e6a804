"""The kestrel-tiny tokenizer: byte-level BPE trained on the corpus's train split.

Special tokens and the chat template are the built-in tokenizer's (`loader.tokenizer_init`), so chat
prompts look the same for every kestrel test model; the vocabulary is separate and larger (8k).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer

from kestrel.loader.tokenizer_init import save_tokenizer, train_byte_level_bpe

VOCAB_SIZE = 8192


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train byte-level BPE on `texts` (pairs seen once are not merged: the corpus is large enough)."""
    return train_byte_level_bpe(texts, vocab_size, min_frequency=2)


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text without special tokens (batched in Rust threads)."""
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


__all__ = ["VOCAB_SIZE", "encode_documents", "save_tokenizer", "train_tokenizer"]
