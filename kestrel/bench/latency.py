"""`kestrel bench latency`: TTFT and decode ms/token per (batch, prompt length), next to the roofline.

For each point the batch's requests (distinct random prompts, prefix caching off, ignore_eos, greedy)
are added at once and the engine is stepped to completion; every step is timed on the host with a
device synchronize on each side. TTFT = from adding the batch to the step that gives its *last* request
its first token (the first request's is reported too). Decode ms/token = median step time over the steps
in which all the batch's requests decode (one token each) and none is prefilling. Median over
`--repeats` runs after `--warmups` short runs of the same shape.

Roofline per decode step = (weight bytes a step reads, i.e. all but the embedding table, + KV bytes at the
mean decode context) / the device-to-device copy bandwidth measured in this run. Prefill roofline =
max(FLOPs / GEMM peak, bytes / bandwidth), the BF16 peak measured in this run (the 8-bit one scaled
from it by the anchors' ratio). The HF transformers peer runs the same weights at batch 1 (eager, and
with its static cache + torch.compile) in a child process before kestrel starts.

`--smoke` runs a tiny random model on the CPU with tiny sizes: a check of the script, not a measurement.
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
from kestrel.bench.checks import correctness_checks
from kestrel.bench.common import Engine
from kestrel.config import ConfigError
from kestrel.sampling_params import SamplingParams

SMOKE = {"batch": "1,2", "input_len": "8,24", "output_len": 4, "repeats": 1, "warmups": 1,
         "max_num_batched_tokens": 32}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ------------------------------------------------------------------------------------------------ timing


def run_batch(engine: Engine, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, Any]:
    """Add every prompt at once, step to completion; TTFTs and the pure-decode step times (seconds): every step
    after each request has its first token, and of those the steps with the whole batch still decoding. Long
    prompts are prefilled a chunk a step, so the first requests decode while the last prefill and finish first:
    only the full-batch steps are steps of `len(prompts)` sequences."""
    core, device = engine.core, engine.runner.device
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    common.synchronize(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    steps: list[float] = []
    full_batch_steps: list[float] = []
    finished = 0
    # A step returns once its sampled ids are on the host, so the time between two returns is one step's
    # time; no extra device synchronization, which would also defeat async scheduling's overlap.
    before = start
    while core.has_unfinished_requests():
        decoding_only = len(first) == len(prompts)
        full_batch = decoding_only and finished == 0
        outputs = core.step()
        after = time.perf_counter()
        if decoding_only:
            steps.append(after - before)
        if full_batch and not any(out.finished for out in outputs):
            full_batch_steps.append(after - before)
        before = after
        for out in outputs:
            finished += out.finished
            tokens[out.request_id] = len(out.outputs[0].token_ids)
            if tokens[out.request_id] and out.request_id not in first:
                first[out.request_id] = after
    produced = sum(tokens.values())
    if produced != len(prompts) * output_len:
        raise RuntimeError(f"{tag}: expected {len(prompts) * output_len} output tokens, got {produced}")
    return {"ttft_s": max(first.values()) - start, "first_ttft_s": min(first.values()) - start, "steps": steps,
            "full_batch_steps": full_batch_steps}


def fits(engine: Engine, batch: int, total_len: int) -> bool:
    block = engine.runner.block_size
    blocks = batch * -(-total_len // block)
    return blocks <= engine.runner.num_blocks and batch <= engine.config.scheduler.max_num_seqs


def measure_point(engine: Engine, batch: int, input_len: int, output_len: int, repeats: int, warmups: int,
                  vocab: int) -> dict[str, Any]:
    row: dict[str, Any] = {"batch": batch, "input_len": input_len, "output_len": output_len}
    if not fits(engine, batch, input_len + output_len):
        row["skipped"] = (f"KV cache holds {engine.runner.num_blocks * engine.runner.block_size} tokens, "
                          f"the batch needs {batch * (input_len + output_len)}")
        return row
    seed = batch * 100_003 + input_len
    for w in range(warmups):
        run_batch(engine, common.random_prompts(batch, input_len, vocab, seed + w), min(output_len, 4),
                  f"warm{batch}x{input_len}-{w}")
    runs = [run_batch(engine, common.random_prompts(batch, input_len, vocab, seed + 1000 + r), output_len,
                      f"run{batch}x{input_len}-{r}") for r in range(repeats)]
    steps = [s for run in runs for s in run["steps"]]
    full = [s for run in runs for s in run["full_batch_steps"]]
    row.update(
        ttft_ms=1e3 * common.median([r["ttft_s"] for r in runs]),
        first_request_ttft_ms=1e3 * common.median([r["first_ttft_s"] for r in runs]),
        decode_ms_per_token=1e3 * common.median(steps) if steps else None,
        decode_mean_ms=1e3 * sum(steps) / len(steps) if steps else None,
        decode_full_batch_ms=1e3 * common.median(full) if full else None,
        decode_full_batch_mean_ms=1e3 * sum(full) / len(full) if full else None,
        full_batch_steps_timed=len(full),
        decode_p10_ms=1e3 * common.percentile(steps, 0.1) if steps else None,
        decode_p90_ms=1e3 * common.percentile(steps, 0.9) if steps else None,
        decode_steps_timed=len(steps), repeats=repeats,
    )
    return row


# ------------------------------------------------------------------------------------------------ roofline


def add_roofline(row: dict[str, Any], engine: Engine, ceilings: dict[str, Any], eight_bit: bool) -> None:
    if "skipped" in row:
        return
    hf_config = engine.config.model.hf_config
    bandwidth = ceilings["copy_TBps"] * 1e12
    peak = (ceilings["eight_bit_TFLOPs"] if eight_bit else ceilings["bf16_TFLOPs"]) * 1e12
    weights = common.step_weight_bytes(common.runner_weight_bytes(engine.runner), row["batch"])
    per_token_kv = common.kv_bytes_per_token(engine.runner)
    b, n, out = row["batch"], row["input_len"], row["output_len"]
    mean_context = n + out / 2
    decode_bytes = weights + b * mean_context * per_token_kv
    row["decode_roofline_ms"] = 1e3 * decode_bytes / bandwidth
    prefill_flops = 2.0 * common.linear_params(hf_config) * b * n + b * common.attention_flops(hf_config, n, n)
    prefill_bytes = weights + b * n * per_token_kv
    row["ttft_roofline_ms"] = 1e3 * max(prefill_flops / peak, prefill_bytes / bandwidth)
    if row.get("decode_ms_per_token"):
        row["decode_x_roofline"] = row["decode_ms_per_token"] / row["decode_roofline_ms"]
    row["ttft_x_roofline"] = row["ttft_ms"] / row["ttft_roofline_ms"]


def run_peers(modes: list[str], model_dir: str, device: torch.device, args: argparse.Namespace,
              input_lens: list[int]) -> dict[str, Any]:
    """One child process per mode, so that a slow compile that times out does not lose the eager numbers."""
    merged: dict[str, Any] = {"rows": [], "runs": {}}
    for mode in modes:
        common.log(f"HF transformers peer: {mode} at batch 1")
        result = common.run_hf_peer({"kind": "latency", "model": model_dir, "device": device.type,
                                     "dtype": "float32" if args.smoke else "bfloat16", "modes": [mode],
                                     "input_lens": input_lens, "output_len": args.output_len,
                                     "repeats": args.repeats, "warmups": args.warmups,
                                     "vocab": common.prompt_vocab(model_dir)}, args.hf_timeout)
        merged["rows"].extend(result.pop("rows", []))
        merged["runs"][mode] = result
    return merged


def add_hf(rows: list[dict[str, Any]], hf: dict[str, Any]) -> None:
    for peer in hf.get("rows", []):
        for row in rows:
            if row["batch"] == 1 and row["input_len"] == peer["input_len"] and row.get("decode_ms_per_token"):
                key = peer["mode"].replace("-", "_")
                row[f"hf_{key}_decode_ms"] = peer["decode_ms_per_token"]
                row[f"hf_{key}_ttft_ms"] = peer["ttft_ms"]
                row[f"speedup_vs_hf_{key}"] = peer["decode_ms_per_token"] / row["decode_ms_per_token"]


# Issue 11's latency targets: batch-1 decode within these factors of the roofline (shortest prompt), FP8 batch-32
# decode within 1.6x, and the TTFT of a batch-1 prompt of at most 128 tokens within 10 ms. Issue 29 adds: the TTFT
# of a batch-1 prompt of 8k tokens or more within 1.3x its floor (its linear and attention FLOPs at the measured
# GEMM rate, or its bytes at the copy bandwidth where they take longer: `ttft_roofline_ms`).
DECODE_ROOFLINE_FACTORS = {"bf16": 1.2, "fp8": 1.4}
BATCH32_ROOFLINE_FACTORS = {"fp8": 1.6}
TTFT_LIMIT_MS = 10.0
LONG_PROMPT = 8192
LONG_TTFT_ROOFLINE_FACTOR = 1.3


def evaluate_targets(rows: list[dict[str, Any]], precision: str, smoke: bool) -> list[dict[str, Any]]:
    """Pass/fail of the latency targets for the rows measured (a target whose row is missing is left out)."""
    def shortest(batch: int) -> dict[str, Any] | None:
        done = [r for r in rows if r["batch"] == batch and r.get("decode_ms_per_token")]
        return min(done, key=lambda r: r["input_len"]) if done else None

    def target(text: str, limit: float, measured: float) -> dict[str, Any]:
        return {"target": text, "limit_ms": limit, "measured_ms": measured, "pass": measured <= limit}

    targets = []
    long_rows = [r for r in rows if r["batch"] == 1 and r["input_len"] >= LONG_PROMPT and "skipped" not in r]
    if long_rows and not smoke:
        longest = max(long_rows, key=lambda r: r["input_len"])
        targets.append(target(f"TTFT <= {LONG_TTFT_ROOFLINE_FACTOR}x its floor ({precision}, batch 1, prompt "
                              f"{longest['input_len']})", LONG_TTFT_ROOFLINE_FACTOR * longest["ttft_roofline_ms"],
                              longest["ttft_ms"]))
    row = shortest(1)
    if row is None:
        return targets
    factor = DECODE_ROOFLINE_FACTORS.get(precision, common.ROOFLINE_FACTOR)
    targets.append(target(f"batch-1 decode <= {factor}x roofline ({precision}, prompt {row['input_len']})",
                          factor * row["decode_roofline_ms"], row["decode_ms_per_token"]))
    row32 = shortest(32)
    if row32 is not None and precision in BATCH32_ROOFLINE_FACTORS:
        factor32 = BATCH32_ROOFLINE_FACTORS[precision]
        targets.append(target(f"batch-32 decode <= {factor32}x roofline ({precision}, prompt {row32['input_len']})",
                              factor32 * row32["decode_roofline_ms"], row32["decode_ms_per_token"]))
    if row["input_len"] <= 128 and not smoke:
        targets.append(target(f"TTFT <= {TTFT_LIMIT_MS:.0f} ms ({precision}, batch 1, prompt {row['input_len']})",
                              TTFT_LIMIT_MS, row["ttft_ms"]))
    return targets


# ------------------------------------------------------------------------------------------------ report


def summary(result: dict[str, Any]) -> str:
    lines = [f"latency: {result['config']['precision']} weights, KV {result['config']['kv_cache_dtype']}, "
             f"copy {result['ceilings']['copy_TBps']:.2f} TB/s, startup {result['startup_s']:.1f} s",
             f"{'batch':>5} {'prompt':>6} {'TTFT ms':>9} {'roof':>8} {'decode ms':>9} {'roof':>7} {'x roof':>6} "
             f"{'HF eager':>8} {'HF comp':>8}"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"{r['batch']:>5} {r['input_len']:>6}  skipped: {r['skipped']}")
            continue
        lines.append(f"{r['batch']:>5} {r['input_len']:>6} {r['ttft_ms']:9.2f} {r['ttft_roofline_ms']:8.2f} "
                     f"{_f(r.get('decode_ms_per_token'), 9)} {r['decode_roofline_ms']:7.3f} "
                     f"{_f(r.get('decode_x_roofline'), 6)} {_f(r.get('hf_eager_decode_ms'), 8)} "
                     f"{_f(r.get('hf_static_compile_decode_ms'), 8)}")
    for t in result["targets"]:
        lines.append(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['measured_ms']:.3f} ms "
                     f"(limit {t['limit_ms']:.3f})")
    for c in result.get("checks", []):
        detail = (f"{c['identical_sequences']}/{c['sequences']} identical" if "sequences" in c
                  else ", ".join(f"batch {n}: {r['identical_sequences']}/{r['sequences']} identical"
                                 for n, r in c["batches"].items()))
        lines.append(f"{'PASS' if c['pass'] else 'FAIL'}  check: {c['check']} ({c['model']}, {c['dtype']}"
                     f"{', ' + c['quantization'] if c.get('quantization') else ''}): {detail}")
    return "\n".join(lines)


def _f(value: float | None, width: int) -> str:
    return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}}"


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    rows = [r for r in result["rows"] if "skipped" not in r]
    if not rows:
        return False
    labels = [f"{r['batch']}x{r['input_len']}" for r in rows]
    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(rows) + 4), 4.5))
    for ax, key, title in ((axes[0], "decode", "decode ms / step"), (axes[1], "ttft", "TTFT ms (whole batch)")):
        measured = [r.get("decode_ms_per_token" if key == "decode" else "ttft_ms") or 0 for r in rows]
        roof = [r[f"{key}_roofline_ms"] for r in rows]
        name = "decode" if key == "decode" else "ttft"
        series = [("kestrel", measured), ("roofline", roof),
                  ("HF eager (batch 1)", [r.get(f"hf_eager_{name}_ms") or 0 for r in rows]),
                  ("HF static cache + compile (batch 1)", [r.get(f"hf_static_compile_{name}_ms") or 0 for r in rows])]
        series = [(label, values) for label, values in series if any(values)]
        width = 0.8 / len(series)
        for j, (label, values) in enumerate(series):
            ax.bar([i + (j - (len(series) - 1) / 2) * width for i in x], values, width, label=label)
        ax.set_xticks(x, labels, rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("batch x prompt tokens")
        ax.legend(fontsize=8)
    fig.suptitle(f"kestrel latency, {result['config']['precision']} / KV {result['config']['kv_cache_dtype']} "
                 f"({result['environment'].get('gpu')})")
    return common.save_figure(plt, fig, path)


# ------------------------------------------------------------------------------------------------ entry


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_arguments(p)
    p.add_argument("--batch", default="1,8,32,128", help="comma-separated batch sizes")
    p.add_argument("--input-len", default="128,1024,8192", help="comma-separated prompt lengths")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmups", type=int, default=1)
    p.add_argument("--hf-peer", default="eager", help="comma-separated: eager, static-compile, or none")
    p.add_argument("--hf-result", type=Path, default=None,
                   help="reuse the HF peer of an earlier latency result file instead of running it")
    p.add_argument("--hf-timeout", type=float, default=300.0, help="seconds for each HF peer process (one per mode)")
    common.add_report_arguments(p)
    p.add_argument("--no-checks", dest="checks", action="store_false",
                   help="skip the correctness checks run first on a GPU (kestrel vs HF greedy, graphs vs eager)")


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "latency", "TTFT and decode ms/token vs roofline and HF transformers",
                          add_arguments, run)


def apply_smoke(args: argparse.Namespace) -> None:
    args.batch, args.input_len = SMOKE["batch"], SMOKE["input_len"]
    args.output_len, args.repeats, args.warmups = SMOKE["output_len"], SMOKE["repeats"], SMOKE["warmups"]
    args.max_num_batched_tokens, args.dtype = SMOKE["max_num_batched_tokens"], "float32"
    args.quantization, args.kv_cache_dtype = None, "auto"


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        apply_smoke(args)
        with tempfile.TemporaryDirectory() as tmp:
            args.weights_dir = Path(tmp)
            return _run(args, torch.device("cpu"))
    return _run(args, common.bench_device(args, "latency"))


def _run(args: argparse.Namespace, device: torch.device) -> int:
    batches, input_lens = int_list(args.batch), int_list(args.input_len)
    hf_modes = [] if args.hf_result else [m for m in args.hf_peer.split(",") if m and m != "none"]
    if any(m not in ("eager", "static-compile") for m in hf_modes):
        raise ConfigError(f"invalid --hf-peer={args.hf_peer!r}: expected eager, static-compile or none")
    checks = []
    if args.checks and device.type == "cuda":
        common.log("correctness checks: kestrel-tiny vs HF transformers (bf16), CUDA graphs vs eager")
        checks = correctness_checks(device.type)
        common.release(None)
    ceilings = common.measure_ceilings(device)
    model_dir, load_format = common.prepare_model(args.model, args.arch, args.smoke, args.weights_dir,
                                                  bool(hf_modes), device, args.weight_only, args.group_size)
    hf: dict[str, Any] = {}
    if args.hf_result:
        hf = common.load_hf_result(args.hf_result, "latency", args.output_len)
    elif hf_modes:
        hf = run_peers(hf_modes, model_dir, device, args, input_lens)
    engine = common.build_suite_engine(args, model_dir, load_format, device, max(batches),
                                       max(input_lens) + args.output_len + 1)
    common.log(f"engine built in {engine.build_s:.1f} s; KV cache {engine.runner.num_blocks} blocks")
    vocab = common.prompt_vocab(model_dir)
    eight_bit = common.precision(args, model_dir) in ("fp8", "int8")
    rows: list[dict[str, Any]] = []
    result = {
        "suite": "latency",
        "config": {**common.engine_config_block(args, engine, model_dir, load_format), "batches": batches,
                   "input_lens": input_lens, "output_len": args.output_len, "repeats": args.repeats,
                   "warmups": args.warmups},
        "environment": common.environment(device), "ceilings": ceilings, "startup_s": engine.build_s,
        "graphs_ready_s": engine.graphs_ready_s,
        "graph_capture_s": getattr(engine.runner, "capture_seconds", None),
        "startup_phases_s": getattr(engine.runner, "startup_seconds", None),
        "compile_ahead": getattr(engine.runner, "compile_ahead_stats", None),
        "prefill_graph_capture_s": getattr(getattr(engine.runner, "graph_runner", None), "prefill_capture_seconds",
                                           None),
        "weight_bytes": common.runner_weight_bytes(engine.runner),
        "kv_bytes_per_token": common.kv_bytes_per_token(engine.runner),
        "rows": rows, "hf_peer": hf, "targets": [], "checks": checks, "complete": False,
    }
    for batch in batches:
        for input_len in input_lens:
            common.log(f"batch {batch} x prompt {input_len}")
            row = measure_point(engine, batch, input_len, args.output_len, args.repeats, args.warmups, vocab)
            add_roofline(row, engine, ceilings, eight_bit)
            rows.append(row)
            # Each finished point reaches the file at once: a run stopped by a job's time limit keeps them.
            common.write_result(result, args.result_file, quiet=True)
    add_hf(rows, hf)
    result["targets"] = evaluate_targets(rows, common.precision(args, model_dir), args.smoke)
    result["complete"] = True
    common.report(result, summary(result), args.result_file, plot)
    common.release(engine)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("latency", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
