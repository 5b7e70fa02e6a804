"""Offline LLM.generate throughput of two kestrel checkouts on the CPU, each run in its own process, interleaved:
the issue-33 workload (kestrel-tiny, float32, 64 prompts of 100 stdlib token ids, 64 greedy tokens, ignore_eos)
with each checkout's defaults (threads, kernels), so it measures the whole change, settings included.

    .venv/bin/python scripts/cpu_checkout_ab.py BEFORE_DIR AFTER_DIR --rounds 3 --out RESULT.json

BEFORE_DIR / AFTER_DIR: checkouts (e.g. `git worktree add /tmp/before <commit>`); this venv runs both, each with
its checkout first on sys.path. Prints and writes each side's median output tok/s and whether the tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Run inside a checkout: only APIs both sides have (LLM, SamplingParams, the tokenizer, the stdlib corpus).
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from kestrel import LLM, SamplingParams
from kestrel.tiny import corpus, default_model_path
num, length, out_len = (int(x) for x in sys.argv[2:5])
llm = LLM(str(default_model_path()), dtype="float32", device="cpu", enable_prefix_caching=False,
          max_model_len=length + out_len + 1)
ids = []
for _, text in corpus.iter_texts(corpus.eval_files()):
    ids.extend(llm.tokenizer.encode(text, add_special_tokens=False))
    if len(ids) >= num * length:
        break
prompts = [{"prompt_token_ids": ids[i * length:(i + 1) * length]} for i in range(num)]
params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - start
print(json.dumps({"elapsed_s": elapsed, "threads": torch.get_num_threads(),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def run_side(checkout: Path, args: argparse.Namespace) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(checkout), str(args.num_prompts), str(args.input_len),
                           str(args.output_len)], cwd=checkout, capture_output=True, text=True, check=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            runs[name].append(run_side(sides[name], args))
            rate = args.num_prompts * args.output_len / runs[name][-1]["elapsed_s"]
            print(f"round {r}: {name}: {rate:.1f} out tok/s ({runs[name][-1]['threads']} threads)", flush=True)
    out_tokens = args.num_prompts * args.output_len
    result = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "rounds": args.rounds},
              "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
              "identical_tokens": runs["before"][0]["tokens"] == runs["after"][0]["tokens"]}
    for name, checkout in sides.items():
        elapsed = [run["elapsed_s"] for run in runs[name]]
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                             text=True).stdout.strip()
        result[name] = {"checkout": str(checkout), "commit": sha, "threads": runs[name][0]["threads"],
                        "median_s": round(statistics.median(elapsed), 3),
                        "output_tok_per_s": round(out_tokens / statistics.median(elapsed), 1),
                        "runs_s": [round(x, 3) for x in elapsed]}
    result["speedup"] = round(result["after"]["output_tok_per_s"] / result["before"]["output_tok_per_s"], 2)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
