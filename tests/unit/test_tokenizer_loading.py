"""`load_tokenizer` builds the generic fast tokenizer directly where AutoTokenizer would build it (tokenizer_config
names PreTrainedTokenizerFast / TokenizersBackend, tokenizer.json present, no auto_map), and that tokenizer is
AutoTokenizer's: same class, vocabulary, special tokens, chat template and token ids. Other configs go through
AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kestrel.loader import tokenizer as loader
from kestrel.tiny import BUNDLED_MODEL_DIR

TEXTS = ["def __init__(self, x):\n    return x * 2\n", "Café naïve 日本語 🙂 — “quotes”", "  spaces  \n\t", ""]
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_dir(tmp_path: Path, **config_changes) -> Path:
    for name in FILES:
        if (BUNDLED_MODEL_DIR / name).is_file():
            shutil.copy(BUNDLED_MODEL_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_generic_fast_tokenizer_is_autotokenizers(tmp_path: Path) -> None:
    path = str(BUNDLED_MODEL_DIR)
    assert loader._generic_fast(path)
    ours, auto = loader.load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                         auto.pad_token_id)
    assert ours.chat_template == auto.chat_template
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    chat = [{"role": "user", "content": "hello"}]
    if auto.chat_template:
        assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("changes", [{"auto_map": {"AutoTokenizer": ["x.Tok", None]}},
                                     {"tokenizer_class": "GPT2TokenizerFast"}, {"tokenizer_class": None}],
                         ids=["auto_map", "family-class", "no-class"])
def test_other_tokenizer_configs_go_through_autotokenizer(tmp_path: Path, monkeypatch, changes: dict) -> None:
    path = str(tokenizer_dir(tmp_path, **changes))
    assert not loader._generic_fast(path)
    seen = []
    real = AutoTokenizer.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        seen.append(args[0])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(recording))
    if "auto_map" in changes:
        return  # remote code is never run here; the check above is the point
    loader.load_tokenizer(path)
    assert seen == [path]


def test_a_broken_tokenizer_config_is_a_config_error(tmp_path: Path) -> None:
    path = tokenizer_dir(tmp_path)
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(loader.ConfigError, match="tokenizer"):
        loader.load_tokenizer(str(path))


def test_the_modules_preloaded_for_tokenizer_workers_follow_the_path(tmp_path: Path) -> None:
    """The generic fast tokenizer's module where load_tokenizer takes that path, AutoTokenizer's elsewhere."""
    generic = loader.tokenizer_modules(str(BUNDLED_MODEL_DIR))
    assert "transformers.tokenization_utils_tokenizers" in generic
    assert not any("auto" in m for m in generic)
    family = loader.tokenizer_modules(str(tokenizer_dir(tmp_path, tokenizer_class="GPT2TokenizerFast")))
    assert "transformers.models.auto.tokenization_auto" in family
