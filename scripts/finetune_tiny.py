r"""Chat fine-tune of kestrel-tiny on stdlib questions and answers (docs/kestrel-tiny.md, "Chat fine-tune").

GPU (about 3 minutes on one H200):  python scripts/finetune_tiny.py --device cuda --steps 2000 --out OUT_DIR
CPU (the 20-minute run of the docs): python scripts/finetune_tiny.py --device cpu --threads 1 --minutes 20 \
    --batch-size 32 --code-batch-size 4 --code-context 256 --lr 1e-3 --warmup-steps 30 --eval-every 100 \
    --log-every 20 --val-tokens 32768 --max-val-pairs 256 --out /tmp/ft_out

The base defaults to the bundled model (kestrel/models/kestrel-tiny/), which is read, never written: --out
must be another directory. It gets the six model files and finetune_log.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Runnable from a fresh clone without installing kestrel: the repository root goes on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.tiny.finetune import FinetuneOptions, finetune  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    d = FinetuneOptions(out=Path("."))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory (not the base's)")
    p.add_argument("--base", type=Path, default=d.base, help="model directory to start from (default: bundled)")
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help="wall-clock budget of the training loop; the cosine schedule spans it")
    p.add_argument("--steps", type=int, default=None, help="train exactly this many steps instead")
    p.add_argument("--max-total-minutes", type=float, default=None,
                   help="hard cap on the whole run (preparation and the before/after scoring included)")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="question/answer conversations per step")
    p.add_argument("--code-batch-size", type=int, default=d.code_batch_size, help="stdlib source windows per step")
    p.add_argument("--code-context", type=int, default=None, help="tokens per source window (default: the model's)")
    p.add_argument("--code-weight", type=float, default=d.code_weight,
                   help="share of the objective on source windows (the rest on answer tokens)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--val-tokens", type=int, default=d.val_tokens, help="validation source tokens (at most)")
    p.add_argument("--max-val-pairs", type=int, default=d.max_val_pairs)
    p.add_argument("--recall-pairs", type=int, default=d.recall_pairs,
                   help="training pairs whose answer loss is tracked at each validation")
    p.add_argument("--select", default=d.select, choices=["recall", "val", "last"],
                   help="weights written: recall = lowest answer loss on the tracked training pairs while the "
                        "validation source loss stays within --max-source-drift of the base's; val = lowest "
                        "validation loss (unseen pairs and source, mixed as the objective); last = final weights")
    p.add_argument("--max-source-drift", type=float, default=d.max_source_drift,
                   help="nats per token the validation source loss may rise above the base's (select=recall)")
    p.add_argument("--max-train-files", type=int, default=None, help="use this many train files (evenly spread)")
    p.add_argument("--max-pairs", type=int, default=None, help="train on this many pairs (evenly spread)")
    p.add_argument("--heldout-files", type=int, default=None,
                   help="held-out files scored before and after (default: all; 0: skip)")
    p.add_argument("--question", action="append", default=None,
                   help="question answered (greedy) before and after, repeatable (default: four built-in ones)")
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens)
    p.add_argument("--save-dtype", default=d.save_dtype, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    return p


def options_from_args(args: argparse.Namespace) -> FinetuneOptions:
    d = FinetuneOptions(out=args.out)
    return FinetuneOptions(
        out=args.out, base=args.base, minutes=args.minutes, steps=args.steps, max_total_minutes=args.max_total_minutes,
        device=args.device, seed=args.seed, batch_size=args.batch_size, code_batch_size=args.code_batch_size,
        code_context=args.code_context, code_weight=args.code_weight, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, dropout=args.dropout,
        eval_every=args.eval_every, log_every=args.log_every, val_tokens=args.val_tokens,
        max_val_pairs=args.max_val_pairs, recall_pairs=args.recall_pairs, select=args.select,
        max_source_drift=args.max_source_drift, max_train_files=args.max_train_files, max_pairs=args.max_pairs,
        heldout_files=args.heldout_files, questions=tuple(args.question) if args.question else d.questions,
        sample_tokens=args.sample_tokens, save_dtype=args.save_dtype,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    finetune(options_from_args(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
