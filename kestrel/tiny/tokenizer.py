"""The kestrel-tiny tokenizer: byte-level BPE trained on the corpus's train split.

Special tokens and the chat template are the built-in tokenizer's (`loader.tokenizer_init`), so chat
prompts look the same for every kestrel test model; the vocabulary is separate and larger (8k).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kestrel.loader.tokenizer_init import BOS_TOKEN, CHAT_TEMPLATE, END_HEADER, EOS_TOKEN, SPECIAL_TOKENS, START_HEADER

VOCAB_SIZE = 8192
# Large on purpose: the context is config.json's max_position_embeddings; a small value here only makes
# transformers warn when a whole file is encoded (the perplexity bench windows it afterwards).
MODEL_MAX_LENGTH = 1 << 20


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train byte-level BPE on `texts`; the special tokens take the first ids (0 = bos, 1 = eos)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # Like Llama 3, encoding a prompt prepends <|begin_of_text|>, which is also how each training file starts.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (Hugging Face layout)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "additional_special_tokens": [START_HEADER, END_HEADER]}
    _write_json(out / "special_tokens_map.json", special)


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(tok)): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": None,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": added,
        "additional_special_tokens": [START_HEADER, END_HEADER],
        "chat_template": CHAT_TEMPLATE,
    }


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text without special tokens (batched in Rust threads)."""
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
