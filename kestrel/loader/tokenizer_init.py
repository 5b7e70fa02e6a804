"""A small byte-level BPE tokenizer trained on embedded text, for tiny test and demo checkpoints.

The corpus lives in this file (not read from the stdlib or the network) so the trained
tokenizer is byte-for-byte the same on every machine and Python version.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, START_HEADER, END_HEADER]

# Llama-3 style turns; each turn ends with the eos token so chat generation stops without extra config.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and
predicts the next one. Each token is a small piece of text: a word, part of a word, a space or a
punctuation mark. The model turns every token into a vector, mixes the vectors with attention,
and returns a score for each entry of its vocabulary. Sampling picks one entry from those scores.
Once upon a time, there was a little bird who lived in a tall tree near the river. Every morning
the bird sang a song to the sun, and every evening it watched the stars come out one by one.
The weather today is sunny with a light breeze from the west. Tomorrow it will rain in the
afternoon, and the temperature will fall to twelve degrees in the night.
What is the capital of France? The capital of France is Paris. What is the largest planet in
the solar system? Jupiter is the largest planet, and Saturn is the second largest.
Please write a short poem about the sea. The sea is wide and deep and blue; it keeps the secrets
of the ships that sailed it long ago. Thank you! You are welcome. How can I help you today?
I would like to know how a paged cache works. The cache is split into blocks of sixteen tokens;
a table maps each request to its blocks, so memory is given out one block at a time and no space
is wasted. When two requests share a prefix, they share the blocks that hold it.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 100 128 256 512 1000 1024 2048 4096 2024 2025.
Dates and times: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; January,
February, March, April, May, June, July, August, September, October, November, December.
Café, naïve, résumé, über, façade, señor, smørrebrød, Ελληνικά, русский, 日本語, 中文, 한국어.
"""

_CODE = '''\
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    x: float
    y: float

    def distance(self, other: "Point") -> float:
        return math.sqrt((self.x - other.x) ** 2 + (self.y - other.y) ** 2)


def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Cache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[str, int] = {}

    def get(self, key: str) -> int | None:
        return self.items.get(key)

    def put(self, key: str, value: int) -> None:
        if len(self.items) >= self.capacity:
            oldest = next(iter(self.items))
            del self.items[oldest]
        self.items[key] = value


def main() -> None:
    for i in range(10):
        if i % 2 == 0:
            print(f"even: {i}")
        else:
            print(f"odd: {i}")
    try:
        value = int("42")
    except ValueError as error:
        raise RuntimeError("bad value") from error
    print(value, fibonacci(8), Point(0.0, 0.0).distance(Point(3.0, 4.0)))


if __name__ == "__main__":
    main()
'''

_JSON_AND_SHELL = """\
{"model": "llama", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16,
 "temperature": 0.7, "top_p": 0.9, "stream": true, "stop": ["\\n\\n", "###"]}
$ kestrel generate --model ./tiny --prompt "Hello, world" --max-tokens 32 --seed 0
$ python -m pytest tests/unit -q
<html><body><p>Hello &amp; welcome</p></body></html>
SELECT name, count(*) FROM users WHERE age > 18 GROUP BY name ORDER BY name;
"""

CORPUS = [_ENGLISH, _CODE, _JSON_AND_SHELL]


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 1) -> Tokenizer:
    """Byte-level BPE on `texts`; the special tokens take the first ids (0 = bos, 1 = eos)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama 3: encoding a plain prompt prepends <|begin_of_text|>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def build_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train the built-in tokenizer in memory (deterministic: same corpus, fixed order)."""
    return train_byte_level_bpe(CORPUS, vocab_size, min_frequency=1)


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "additional_special_tokens": [START_HEADER, END_HEADER]},
    )


def write_tokenizer(path: str, vocab_size: int = 1024) -> int:
    """Write the built-in tokenizer's files to `path`; return the vocab size."""
    tokenizer = build_tokenizer(vocab_size)
    save_tokenizer(tokenizer, path)
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
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
        "model_max_length": 1 << 20,
        "added_tokens_decoder": added,
        # Listed so transformers' all_special_ids agrees with decode(skip_special_tokens=True).
        "additional_special_tokens": [START_HEADER, END_HEADER],
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
