"""`kestrel bench throughput`: offline throughput, every request at once (infinite request rate), ignore_eos.

Distinct random prompts of `--input-len` tokens, `--output-len` greedy tokens each, prefix caching off.
Reported over the timed run (from adding the requests to the last one finishing): requests/s, output
tokens/s, total (prompt + output) tokens/s. Startup to first token = from building the engine (weights,
KV cache, CUDA graphs) to the first token of a single request. A short warm-up run precedes the timed one.

The HF transformers peer (same weights, in a child process before kestrel starts) runs its continuous
batching (`generate_batch`, static batches when missing) on the first `--hf-peer-prompts` prompts.
Targets: output tok/s >= 10x HF; W8A8-FP8 on 1000 in / 1000 out >= 17,744 output tok/s (TensorRT-LLM's
published figure for Llama-3.1-8B FP8 on one H200), aiming at 19,500; startup to first token < 30 s.
`--smoke` checks the script on a tiny CPU model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kestrel.bench import common, register_suite, standalone_main
from kestrel.bench.common import Engine
from kestrel.sampling_params import SamplingParams

SMOKE = {"num_prompts": 6, "input_len": 12, "output_len": 5, "max_num_seqs": 4, "max_num_batched_tokens": 32,
         "hf_peer_prompts": 3, "warmup_prompts": 2}
FP8_TARGETS_TOK_S = ((17_744.0, "TensorRT-LLM's published figure"), (19_500.0, "the aim"))
HF_FACTOR = 10.0
STARTUP_LIMIT_S = 30.0


def generate_all(engine: Engine, prompts: list[list[int]], output_len: int, tag: str,
                 max_seconds: float | None = None) -> dict[str, Any]:
    """Add every prompt, step until all finish (or `max_seconds` pass: the rest is aborted and the run
    marked truncated, its rates then count the tokens produced so far); elapsed seconds and token counts."""
    core = engine.core
    # Outputs only at the end (as LLM.generate asks); tokens are counted by the scheduler, truncated runs too.
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind="final_only")
    generated_before = core.scheduler.stats.num_generation_tokens
    common.synchronize(engine.runner.device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(f"{tag}-{i}", prompt, params)
    produced: set[str] = set()
    preemptions = finished = steps = 0
    truncated = False
    while core.has_unfinished_requests():
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            core.abort_request([f"{tag}-{i}" for i in range(len(prompts))])
            truncated = True
            break
        steps += 1
        for out in core.step():
            produced.add(out.request_id)
            if out.finished:
                finished += 1
                preemptions += out.metrics.num_preemptions if out.metrics else 0
    common.synchronize(engine.runner.device)
    elapsed = time.perf_counter() - start
    output_tokens = core.scheduler.stats.num_generation_tokens - generated_before
    if not truncated and (finished != len(prompts) or output_tokens != len(prompts) * output_len):
        raise RuntimeError(f"{tag}: {finished}/{len(prompts)} requests finished with {output_tokens} output tokens; "
                           f"expected {len(prompts) * output_len}")
    prompt_tokens = sum(len(p) for i, p in enumerate(prompts) if not truncated or f"{tag}-{i}" in produced)
    return {"elapsed_s": elapsed, "num_prompts": len(prompts), "finished": finished, "output_tokens": output_tokens,
            "prompt_tokens": prompt_tokens, "steps": steps, "preemptions": preemptions, "truncated": truncated}


def rates(run: dict[str, Any]) -> dict[str, float]:
    elapsed = run["elapsed_s"]
    return {"requests_per_s": run["finished"] / elapsed, "output_tok_per_s": run["output_tokens"] / elapsed,
            "total_tok_per_s": (run["output_tokens"] + run["prompt_tokens"]) / elapsed}


def evaluate_targets(result: dict[str, Any], smoke: bool) -> list[dict[str, Any]]:
    ours = result["kestrel"]["output_tok_per_s"]
    targets = []
    hf = result["hf_peer"].get("output_tok_per_s")
    if hf:
        targets.append({"target": f"output tok/s >= {HF_FACTOR:.0f}x HF transformers ({result['hf_peer']['method']})",
                        "limit": HF_FACTOR * hf, "measured": ours, "pass": ours >= HF_FACTOR * hf})
    cfg = result["config"]
    if cfg["quantization"] == "fp8" and cfg["input_len"] == 1000 and cfg["output_len"] == 1000 and not smoke:
        for limit, what in FP8_TARGETS_TOK_S:
            targets.append({"target": f"W8A8-FP8 1000/1000 output tok/s >= {limit:,.0f} ({what})", "limit": limit,
                            "measured": ours, "pass": ours >= limit})
    if not smoke:
        startup = result["startup_to_first_token_s"]
        targets.append({"target": f"startup to first token < {STARTUP_LIMIT_S:.0f} s", "limit": STARTUP_LIMIT_S,
                        "measured": startup, "pass": startup < STARTUP_LIMIT_S})
    return targets


def summary(result: dict[str, Any]) -> str:
    cfg, ours, hf = result["config"], result["kestrel"], result["hf_peer"]
    truncated = " TRUNCATED at --max-seconds: rates over the part done" if ours["truncated"] else ""
    lines = [f"throughput: {cfg['num_prompts']} x ({cfg['input_len']} in / {cfg['output_len']} out), "
             f"{cfg['precision']} weights, KV {cfg['kv_cache_dtype']}; startup to first token "
             f"{result['startup_to_first_token_s']:.1f} s{truncated}",
             f"{'':12}{'prompts':>8}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}",
             f"{'kestrel':12}{ours['num_prompts']:>8}{ours['requests_per_s']:9.2f}{ours['output_tok_per_s']:11.1f}"
             f"{ours['total_tok_per_s']:13.1f}"]
    if hf.get("output_tok_per_s"):
        lines.append(f"{'HF':12}{hf['num_prompts']:>8}{hf['requests_per_s']:9.2f}{hf['output_tok_per_s']:11.1f}"
                     f"{hf['total_tok_per_s']:13.1f}   ({hf['method']})")
    elif hf.get("error"):
        lines.append(f"HF peer failed: {hf['error'][-300:]}")
    return "\n".join(lines + common.target_lines(result["targets"]))


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    names = ["kestrel"]
    values = [result["kestrel"]["output_tok_per_s"]]
    if result["hf_peer"].get("output_tok_per_s"):
        names.append("HF transformers")
        values.append(result["hf_peer"]["output_tok_per_s"])
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.bar(names, values, color=["tab:blue", "tab:gray"][: len(values)])
    for t in result["targets"]:
        if "tok/s" in t["target"]:
            ax.axhline(t["limit"], linestyle="--", linewidth=1, color="tab:red")
            ax.annotate(t["target"], (0, t["limit"]), fontsize=7, va="bottom")
    ax.set_ylabel("output tokens / s")
    cfg = result["config"]
    ax.set_title(f"{cfg['num_prompts']} x {cfg['input_len']}/{cfg['output_len']}, {cfg['precision']}, KV "
                 f"{cfg['kv_cache_dtype']} ({result['environment'].get('gpu')})", fontsize=9)
    return common.save_figure(plt, fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_arguments(p)
    p.add_argument("--num-prompts", type=common.positive_int, default=1500)
    p.add_argument("--input-len", type=common.positive_int, default=1000)
    p.add_argument("--output-len", type=common.positive_int, default=1000)
    p.add_argument("--warmup-prompts", type=int, default=None,
                   help="prompts of the short warm-up run (default --max-num-seqs, so every decode batch size "
                        "and GEMM bucket is compiled before timing)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for the engine (default: the model's; random weights have none, and "
                        "then no structured-outputs backend either)")
    p.add_argument("--grammar-workers", type=int, default=None,
                   help="the engine's grammar_workers: processes holding the grammar matchers, started with the "
                        "engine (needs a tokenizer; default: the engine's, half the usable cores up to 8 on a GPU, "
                        "0 on the CPU)")
    p.add_argument("--max-seconds", type=float, default=420.0,
                   help="abort the timed run after this long and report it as truncated (stays under a job limit)")
    p.add_argument("--hf-peer-prompts", type=int, default=64, help="prompts for the HF peer (0: no peer)")
    p.add_argument("--hf-static-batch", type=int, default=64, help="batch of the HF fallback without generate_batch")
    p.add_argument("--hf-result", type=Path, default=None,
                   help="reuse the HF peer of an earlier throughput result file (same workload) instead of running it")
    p.add_argument("--hf-timeout", type=float, default=300.0, help="seconds for the HF peer process")
    common.add_report_arguments(p)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "throughput", "offline throughput (ignore_eos) vs HF transformers",
                          add_arguments, run)


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.dtype, args.quantization, args.kv_cache_dtype = "float32", None, "auto"
        with tempfile.TemporaryDirectory() as tmp:
            args.weights_dir = Path(tmp)
            return _run(args, torch.device("cpu"))
    return _run(args, common.bench_device(args, "throughput"))


def _run(args: argparse.Namespace, device: torch.device) -> int:
    run_peer = args.hf_peer_prompts > 0 and args.hf_result is None
    model_dir, load_format = common.prepare_model(args.model, args.arch, args.smoke, args.weights_dir,
                                                  run_peer, device, args.weight_only, args.group_size)
    vocab = common.prompt_vocab(model_dir, args.tokenizer)
    hf: dict[str, Any] = {}
    if args.hf_result is not None:
        hf = common.load_hf_result(args.hf_result, "throughput", args.output_len, args.input_len)
    elif run_peer:
        common.log(f"HF transformers peer: {args.hf_peer_prompts} prompts")
        hf = common.run_hf_peer({"kind": "throughput", "model": model_dir, "device": device.type,
                                 "dtype": "float32" if args.smoke else "bfloat16",
                                 "num_prompts": min(args.hf_peer_prompts, args.num_prompts),
                                 "input_len": args.input_len, "output_len": args.output_len, "vocab": vocab,
                                 "seed": 1, "static_batch": args.hf_static_batch,
                                 "static_only": args.smoke}, args.hf_timeout, in_process=args.smoke)
    started = time.perf_counter()
    extra = {name: value for name, value in (("tokenizer", args.tokenizer), ("grammar_workers", args.grammar_workers))
             if value is not None}
    # Graphs left to capture (graph_capture="serving") are captured after the first token, before the warm-up (each
    # capture empties the allocator's caches, which the warm-up fills again for the timed run).
    engine = common.build_suite_engine(args, model_dir, load_format, device, args.max_num_seqs,
                                       args.input_len + args.output_len + 1, capture_graphs_now=False, **extra)
    generate_all(engine, common.random_prompts(1, args.input_len, vocab, seed=0), 1, "first")
    startup = time.perf_counter() - started
    common.log(f"first token {startup:.1f} s after start (engine built in {engine.build_s:.1f} s); "
               f"KV cache {engine.runner.num_blocks} blocks")
    engine.finish_graphs()
    if engine.graphs_ready_s is not None:
        common.log(f"every CUDA graph captured {engine.graphs_ready_s:.1f} s after start")
    warmup_prompts = args.max_num_seqs if args.warmup_prompts is None else args.warmup_prompts
    if warmup_prompts > 0:
        generate_all(engine, common.random_prompts(warmup_prompts, args.input_len, vocab, seed=2),
                     min(args.output_len, 16), "warm")
    common.log(f"timed run: {args.num_prompts} prompts")
    run_stats = generate_all(engine, common.random_prompts(args.num_prompts, args.input_len, vocab, seed=1),
                             args.output_len, "run", max_seconds=args.max_seconds)
    result: dict[str, Any] = {
        "suite": "throughput",
        "config": {**common.engine_config_block(args, engine, model_dir, load_format), "num_prompts": args.num_prompts,
                   "input_len": args.input_len, "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                   "tokenizer": engine.config.model.tokenizer_path if not isinstance(
                       engine.core.tokenizer, common.NullTokenizer) else None,
                   "grammar_workers": (None if engine.core.structured is None
                                       else engine.core.structured.worker_count)},
        "environment": common.environment(device),
        "startup_to_first_token_s": startup, "engine_build_s": engine.build_s,
        "graphs_ready_s": engine.graphs_ready_s,
        "graph_capture_s": getattr(engine.runner, "capture_seconds", None),
        "startup_phases_s": getattr(engine.runner, "startup_seconds", None),
        "compile_ahead": getattr(engine.runner, "compile_ahead_stats", None),
        "kestrel": {**run_stats, **rates(run_stats)}, "hf_peer": hf,
    }
    if hf.get("output_tok_per_s"):
        result["speedup_vs_hf"] = result["kestrel"]["output_tok_per_s"] / hf["output_tok_per_s"]
    result["targets"] = evaluate_targets(result, args.smoke)
    common.report(result, summary(result), args.result_file, plot)
    common.release(engine)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("throughput", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
