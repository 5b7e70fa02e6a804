"""A Llama-3-8B-shaped model directory for serving random weights (`--load-format dummy`): config.json plus a
word-level tokenizer with one token per id of the 128,256-entry vocabulary, so every sampled id detokenizes.

    python scripts/write_serve_model.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.bench.common import LLAMA3_8B  # noqa: E402


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA3_8B)
    vocab_size = config["vocab_size"]
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<|begin_of_text|>"] = bos
    vocab["<|end_of_text|>"] = eos
    del vocab[f"t{bos}"], vocab[f"t{eos}"]
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=f"t{0}"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "model_max_length": 131072}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
