"""Write the large-vocabulary tokenizer `kestrel bench structured` compiles its grammars against.

    python scripts/write_bench_tokenizer.py [--out .bench-tokenizer-128k] [--vocab-size 128256]

Byte-level BPE trained on the kestrel-tiny training corpus (the stdlib's train split); on CPython 3.11.7 the corpus
yields 76,290 tokens whatever larger size is asked. A grammar's mask fill scans the vocabulary, so its size is what
the benchmark needs to be realistic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.loader.tokenizer_init import save_tokenizer  # noqa: E402
from kestrel.tiny import corpus  # noqa: E402
from training.tiny.tokenizer import train_tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".bench-tokenizer-128k")
    parser.add_argument("--vocab-size", type=int, default=128256)
    args = parser.parse_args()
    tokenizer = train_tokenizer(corpus.texts(corpus.train_files()), vocab_size=args.vocab_size)
    save_tokenizer(tokenizer, args.out)
    print(f"wrote {args.out}: {tokenizer.get_vocab_size(with_added_tokens=True)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
