"""Train kestrel-tiny and write its Hugging Face directory (docs/kestrel-tiny.md).

GPU (about ten minutes on one H200):  python scripts/train_tiny.py --device cuda --minutes 8 --out OUT_DIR
CPU smoke run of the whole pipeline:   python scripts/train_tiny.py --device cpu --minutes 0.5 --out /tmp/tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Runnable from a fresh clone without installing kestrel: the repository root goes on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.tiny.model import TinyConfig  # noqa: E402
from training.tiny.train import TrainOptions, train  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainOptions(out=Path("."))
    arch = TinyConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory (the 8 files of the model)")
    p.add_argument("--minutes", type=float, default=defaults.minutes,
                   help="wall-clock budget of the training loop; the cosine schedule spans it")
    p.add_argument("--steps", type=int, default=None,
                   help="train exactly this many steps instead (the schedule spans them; reproducible)")
    p.add_argument("--max-total-minutes", type=float, default=None,
                   help="hard cap on the whole run, preparation included: training stops early enough to "
                        "save before it (use under an outside time limit)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="reuse this directory's tokenizer.json")
    p.add_argument("--max-train-files", type=int, default=None, help="train on this many files (evenly spread)")
    p.add_argument("--vocab-size", type=int, default=arch.vocab_size)
    p.add_argument("--hidden-size", type=int, default=arch.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=arch.intermediate_size)
    p.add_argument("--layers", type=int, default=arch.num_layers)
    p.add_argument("--heads", type=int, default=arch.num_heads)
    p.add_argument("--kv-heads", type=int, default=arch.num_kv_heads)
    p.add_argument("--context", type=int, default=arch.max_position)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--min-lr-ratio", type=float, default=defaults.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    p.add_argument("--dropout", type=float, default=defaults.dropout)
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--log-every", type=int, default=defaults.log_every)
    p.add_argument("--val-tokens", type=int, default=defaults.val_tokens,
                   help="validation tokens per evaluation (at most; lower it for CPU runs)")
    p.add_argument("--save-dtype", default=defaults.save_dtype, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--compile", action="store_true", help="torch.compile the training step")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (1 is fastest for tiny models on a busy machine)")
    return p


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    arch = TinyConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, max_position=args.context)
    return TrainOptions(
        out=args.out, minutes=args.minutes, steps=args.steps, max_total_minutes=args.max_total_minutes,
        device=args.device, seed=args.seed, model=arch, tokenizer_dir=args.tokenizer_dir,
        max_train_files=args.max_train_files, batch_size=args.batch_size, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, dropout=args.dropout,
        eval_every=args.eval_every, log_every=args.log_every, val_tokens=args.val_tokens, save_dtype=args.save_dtype,
        compile=args.compile,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    train(options_from_args(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
