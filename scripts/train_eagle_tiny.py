"""Train a draft proposer for kestrel-tiny and write it as a Hugging Face-style directory with train_log.json
(held-out acceptance before and after training): an EAGLE-style head (`--kind eagle`, config.json +
model.safetensors) or a 2-layer draft model (`--kind draft`, a full checkpoint with the tokenizer files).

GPU (a few minutes on one H200):
  python scripts/train_eagle_tiny.py --kind eagle --device cuda --minutes 3 --out OUT/eagle-kestrel-tiny
  python scripts/train_eagle_tiny.py --kind draft --device cuda --minutes 2 --out OUT/draft-kestrel-tiny
CPU smoke run:
  python scripts/train_eagle_tiny.py --kind eagle --device cpu --steps 5 --out /tmp/eagle
Serve with speculative_config={"method": "eagle", "model": OUT/eagle-kestrel-tiny, "num_speculative_tokens": 4}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Runnable from a fresh clone without installing kestrel: the repository root goes on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.tiny import default_model_path  # noqa: E402
from training.tiny.eagle import KINDS, DraftTrainOptions, train_draft  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    d = DraftTrainOptions(target=Path("."), out=Path("."))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--kind", choices=KINDS, default=d.kind)
    p.add_argument("--target", type=Path, default=None, help="the target's directory (default: the bundled "
                   "kestrel-tiny)")
    p.add_argument("--steps", type=int, default=d.steps, help="most training steps")
    p.add_argument("--minutes", type=float, default=d.minutes, help="wall-clock cap of the training loop")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--context", type=int, default=d.context)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--draft-layers", type=int, default=d.draft_layers, help="--kind draft: layers kept")
    p.add_argument("--max-train-files", type=int, default=d.max_train_files,
                   help="train-split files to tokenize (evenly spread; 0: all)")
    p.add_argument("--max-eval-files", type=int, default=d.max_eval_files, help="held-out files for acceptance")
    p.add_argument("--eval-positions", type=int, default=d.eval_positions,
                   help="held-out positions the acceptance is measured at")
    p.add_argument("--eval-prefix", type=int, default=d.eval_prefix, help="tokens of context before each")
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="k of the acceptance measurement")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = DraftTrainOptions(
        target=args.target or Path(default_model_path()), out=args.out, kind=args.kind, steps=args.steps,
        minutes=args.minutes, device=args.device, seed=args.seed, batch_size=args.batch_size, context=args.context,
        lr=args.lr, draft_layers=args.draft_layers, max_train_files=args.max_train_files or None,
        max_eval_files=args.max_eval_files, eval_positions=args.eval_positions, eval_prefix=args.eval_prefix,
        num_speculative_tokens=args.num_speculative_tokens)
    log = train_draft(opts)
    print(json.dumps({"out": str(opts.out), "steps": log["steps"], "acceptance_before": log["acceptance_before"],
                      "acceptance": log["acceptance"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
