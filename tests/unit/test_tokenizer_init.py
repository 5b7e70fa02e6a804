"""The built-in tokenizer: trains fast, loads offline with transformers, round-trips, is deterministic."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kestrel.loader.tokenizer_init import BOS_TOKEN, EOS_TOKEN, write_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x: int) -> int:\n    return x * 2\n",
    "Café naïve 日本語 한국어 🙂🚀 — “quotes”",
    "  leading and trailing spaces  \n\n\t",
]


# The tokenizer is written under a time bound: run alone, after the rest (`make test`).
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    start = time.perf_counter()
    assert write_tokenizer(str(path)) == 1024
    assert time.perf_counter() - start < 5.0
    return path


@pytest.fixture(scope="module")
def tokenizer(tok_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def test_files_written(tok_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tok_dir / name).is_file()


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.bos_token == BOS_TOKEN
    assert tokenizer.eos_token == EOS_TOKEN
    assert len(tokenizer) == 1024
    assert tokenizer.eos_token_id in tokenizer.all_special_ids


def test_all_special_ids_match_skip_special_tokens(tokenizer) -> None:
    """Incremental detokenization filters by all_special_ids; decode() must skip exactly those."""
    ids = list(range(len(tokenizer)))
    kept = [i for i in ids if i not in set(tokenizer.all_special_ids)]
    assert len(kept) == len(ids) - 4
    assert tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(kept)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:]) == text


def test_deterministic_across_writes(tmp_path: Path, tok_dir: Path) -> None:
    write_tokenizer(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes()


def test_smaller_vocab(tmp_path: Path) -> None:
    assert write_tokenizer(str(tmp_path), vocab_size=512) == 512


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(BOS_TOKEN)
    assert text.count(BOS_TOKEN) == 1
    for message in messages:
        assert f"{message['role']}<|end_header_id|>\n\n{message['content']}{EOS_TOKEN}" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without.endswith(EOS_TOKEN)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == text
