"""Host time per token of one sequence's detokenizer along a long output: `IncrementalDetokenizer.update` and
`get_delta` (a streamed request's step) token by token over the token ids of Python's own source files, with and
without a stop string, in CPU microseconds per token for each window of the output. A cost that grows with the
window's position is a step that copies the whole text so far.

    python scripts/detokenizer_long_output.py --tokenizer .bench-tokenizer-128k --tokens 32000 --rounds 3 \\
        [--before COMMIT] --out benchmarks/results/issue29/detokenizer-long-output.json

`--before COMMIT`: the same measurement of that commit's tree (written out with `git archive`), alternated with the
working tree's round by round, both in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = (1000, 4000, 8000, 16000, 32000)


def measure(tokenizer_dir: str, num_tokens: int) -> dict[str, dict[str, float]]:
    from kestrel.engine.detokenizer import IncrementalDetokenizer, TokenizerLookups
    from kestrel.loader.tokenizer import load_tokenizer
    from kestrel.sampling_params import SamplingParams

    tokenizer = load_tokenizer(tokenizer_dir)
    lookups = TokenizerLookups(tokenizer)
    sources = sorted(Path(os.__file__).parent.glob("*.py"))
    ids: list[int] = []
    for source in sources:
        ids += tokenizer.encode(source.read_text(errors="replace"), add_special_tokens=False)
        if len(ids) > num_tokens:
            break
    ids = ids[:num_tokens]
    out: dict[str, dict[str, float]] = {}
    for name, stop in (("no_stop", []), ("stop_string", ["\x00never\x00"])):
        detok = IncrementalDetokenizer(tokenizer, ids[:8], SamplingParams(max_tokens=num_tokens, stop=stop),
                                       lookups)
        marks = [w for w in WINDOWS if w <= num_tokens]
        per_window: dict[str, float] = {}
        started, first = time.thread_time(), 0
        for i, token in enumerate(ids, 1):
            detok.update([token])
            detok.get_delta(False)
            if marks and i == marks[0]:
                now = time.thread_time()
                per_window[f"{first}-{i}"] = 1e6 * (now - started) / (i - first)
                started, first = now, i
                marks.pop(0)
        out[name] = per_window
    return out


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    code = (f"import json, sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(0, {str(ROOT / 'scripts')!r}); "
            f"import detokenizer_long_output as d; print(json.dumps(d.measure({args.tokenizer!r}, {args.tokens})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--tokens", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default=None, help="a commit measured alternately with the working tree")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.tokenizer = str(Path(args.tokenizer).resolve())
    trees = {"after": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            before = Path(tmp) / "before"
            before.mkdir()
            archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
            trees = {"before": before, "after": ROOT}
        rounds: dict[str, list] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                rounds[name].append(run_tree(tree, args))
                print(f"round {r + 1} {name}: {json.dumps(rounds[name][-1])}", file=sys.stderr)
    medians = {name: {case: {w: statistics.median(rr[case][w] for rr in runs) for w in runs[0][case]}
                      for case in runs[0]} for name, runs in rounds.items()}
    result = {"command": " ".join(sys.argv), "before": args.before, "tokens": args.tokens,
              "unit": "CPU us per token (update + get_delta), median over rounds", "median": medians,
              "rounds": rounds}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, cases in medians.items():
        for case, windows in cases.items():
            print(f"{name:<7} {case:<12} " + "  ".join(f"{w}: {v:.2f}" for w, v in windows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
