"""Greedy outputs of tensor and pipeline parallelism against one rank, on one checkpoint and a fixed prompt set.

    python scripts/parallel_parity.py --result-file OUT/greedy-parity.json [--smoke] [--quantization fp8]

The same random checkpoint (the Llama-3-8B shape, written once under --weights-dir and shared; a tiny one on the
CPU with --smoke) is loaded by TP = 1 in process, then TP = 2 and PP = 2 through the `mp` executor (one GPU per
rank; gloo processes on the CPU). Each runs the same seeded prompts (several lengths) to `--output-len` greedy
tokens with ignore_eos. Reported per configuration: engine errors (an exception from a step, or a request that
did not finish with every token), and per prompt whether its tokens equal TP = 1's and where they first differ.
PP = 2 runs the same arithmetic per layer as TP = 1, so it must match exactly; TP = 2 sums each row-parallel
layer's partial products in another order, so in BF16 a near-tie of the top two logits can flip; the first
divergence position says how far the outputs agreed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kestrel.bench import common
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.sampling_params import SamplingParams

CONFIGS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
PROMPT_LENS = (7, 16, 33, 64, 128, 200, 256, 512)
SMOKE_PROMPT_LENS = (5, 9, 17)


def prompts_for(lens: tuple[int, ...], vocab: int) -> list[list[int]]:
    return [common.random_prompts(1, n, vocab, seed=1000 + i)[0] for i, n in enumerate(lens)]


def run_config(name: str, model_dir: str, args: argparse.Namespace, device: torch.device,
               prompts: list[list[int]]) -> dict[str, Any]:
    tp, pp = CONFIGS[name]
    record: dict[str, Any] = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "errors": [], "outputs": []}
    engine = None
    started = time.perf_counter()
    try:
        engine = common.build_engine(
            model_dir, dtype=args.dtype, device=device.type, quantization=args.quantization,
            enable_prefix_caching=False, max_num_seqs=len(prompts),
            max_model_len=max(map(len, prompts)) + args.output_len + 1,
            tensor_parallel_size=tp, pipeline_parallel_size=pp,
            distributed_executor_backend="mp" if tp * pp > 1 else None)
        core = engine.core
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            core.add_request(f"{name}-{i}", prompt, params)
        done: dict[int, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    done[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
        record["outputs"] = [done.get(i, []) for i in range(len(prompts))]
        short = [i for i, ids in enumerate(record["outputs"]) if len(ids) != args.output_len]
        if short:
            record["errors"].append(f"prompts {short} did not finish with {args.output_len} tokens")
    except Exception:  # noqa: BLE001 - an engine error is a result here, reported with its traceback
        record["errors"].append(traceback.format_exc()[-3000:])
    finally:
        if engine is not None and hasattr(engine.runner, "shutdown"):
            engine.runner.shutdown()
        common.release(engine)
    record["wall_s"] = time.perf_counter() - started
    return record


def compare(reference: list[list[int]], other: list[list[int]]) -> list[dict[str, Any]]:
    rows = []
    for i, (a, b) in enumerate(zip(reference, other, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"prompt": i, "identical": first is None, "first_divergence": first})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--result-file", type=Path, required=True)
    p.add_argument("--weights-dir", type=Path, default=None,
                   help="the random 8B checkpoint (written if absent; default /tmp/kestrel-bench-llama3-8b)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, choices=["fp8", "int8"])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="a tiny float32 checkpoint on the CPU (gloo ranks)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args.dtype, args.quantization, args.output_len = "float32", None, 6
            device = torch.device("cpu")
            model_dir = tmp
            write_tiny_checkpoint(model_dir, "llama", "tiny", **common.SMOKE_OVERRIDES)
            lens = SMOKE_PROMPT_LENS
        else:
            device = torch.device("cuda")
            weights_dir = args.weights_dir or common.default_weights_dir("llama3-8b")
            common.write_random_checkpoint(weights_dir, common.LLAMA3_8B, device)
            model_dir = str(weights_dir)
            lens = PROMPT_LENS
        prompts = prompts_for(lens, common.prompt_vocab(model_dir))
        runs = {name: run_config(name, model_dir, args, device, prompts) for name in CONFIGS}
    reference = runs["tp1"]["outputs"]
    result: dict[str, Any] = {
        "suite": "greedy-parity",
        "config": {"model": "tiny" if args.smoke else "llama3-8b random checkpoint", "dtype": args.dtype,
                   "quantization": args.quantization, "prompt_lens": list(lens), "output_len": args.output_len,
                   "smoke": args.smoke},
        "environment": common.environment(device),
        "runs": {name: {k: v for k, v in run.items() if k != "outputs"} for name, run in runs.items()},
        "tp1_outputs": reference,
        "targets": [],
    }
    for name, run in runs.items():
        result["targets"].append({"target": f"{name}: zero engine errors", "measured": len(run["errors"]),
                                  "limit": 0, "pass": not run["errors"]})
        if name == "tp1" or runs["tp1"]["errors"] or run["errors"]:
            continue
        rows = compare(reference, run["outputs"])
        result["runs"][name]["prompts"] = rows
        identical = sum(r["identical"] for r in rows)
        result["targets"].append({"target": f"{name}: greedy outputs equal tp1's (prompts identical)",
                                  "measured": identical, "limit": len(rows), "pass": identical == len(rows)})
    lines = [f"greedy parity: {len(prompts)} prompts x {args.output_len} tokens, {args.dtype}"
             f"{', ' + args.quantization if args.quantization else ''}"]
    for name, run in result["runs"].items():
        firsts = [r["first_divergence"] for r in run.get("prompts", []) if not r["identical"]]
        lines.append(f"  {name}: {len(run['errors'])} errors, {run['wall_s']:.1f} s"
                     + (f", first divergences at {firsts}" if firsts else ""))
    lines += common.target_lines(result["targets"], fmt=".0f")
    print("\n".join(lines))
    common.write_result(result, args.result_file)
    return 0 if all(t["pass"] for t in result["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
