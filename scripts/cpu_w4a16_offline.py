"""Offline greedy decode on the CPU of a W4A16 checkpoint and its float original: 4 prompts x 32 new tokens,
out tok/s over 3 runs after a warm-up, JSON on stdout. Run it once per tree to compare (PYTHONPATH picks the tree):

    kestrel quantize /tmp/qwen2-0.5b-shape /tmp/qwen2-0.5b-w4a16 --scheme w4a16 --algorithm rtn --group-size 128
    PYTHONPATH=. python scripts/cpu_w4a16_offline.py /tmp/qwen2-0.5b-w4a16 /tmp/qwen2-0.5b-shape
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from kestrel import LLM, SamplingParams


def rates(path: str) -> dict:
    llm = LLM(model=path, device="cpu")
    prompts = [f"Question {i}: what is the capital of country number {i}?" for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return {"model": path, "out_tok_s_runs": runs, "out_tok_s_median": statistics.median(runs)}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps({"w4a16": rates(argv[0]), "float": rates(argv[1])}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
