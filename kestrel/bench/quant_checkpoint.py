"""`kestrel bench quant-checkpoint`: a checkpoint written by `kestrel quantize` against quantization at load.

One job: the architecture's random BF16 checkpoint is written, then quantized by `kestrel quantize`'s
`quantize_checkpoint` for each `--schemes` entry (static scales calibrated on random token sequences: the
weights are random too); then, per scheme, the throughput and the batch-1 latency suites run on the float
checkpoint with the matching `--quantization` flag (quantization at load) and on the quantized checkpoint,
alternately and each in its own process, so that each starts with the whole device free and its start-up
(engine build: weights, quantization, KV cache, CUDA graphs) is timed from a cold engine. The page cache
holds every checkpoint file by then (all were just written), so start-up compares the work after reading.

Targets per scheme: checkpoint throughput >= 97% and batch-1 decode ms/token <= 103% of quantization at
load; engine build faster. `--smoke` runs it all on a tiny CPU model (a check of the script, not a
measurement); `--from-result FILE` prints and plots an earlier result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kestrel.bench import common, register_suite, standalone_main
from kestrel.config import ConfigError
from kestrel.loader.hf_config import load_hf_config
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.registry import model_skeleton
from kestrel.quant.calibrate import SCHEMES, QuantizeOptions, quantization_config, quantize_checkpoint

ONLINE_FLAG = {"fp8-dynamic": "fp8", "fp8-static": "fp8", "w8a8-int8": "int8", "w8a8-int8-static": "int8"}
THROUGHPUT_MIN_RATIO = 0.97
LATENCY_MAX_RATIO = 1.03
SMOKE = {"num_prompts": 4, "input_len": 12, "output_len": 4, "max_num_seqs": 4, "latency_output_len": 4,
         "calibration_samples": 2, "calibration_len": 16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="llama3-8b", choices=sorted(common.ARCHS))
    p.add_argument("--weights-dir", type=Path, default=Path("/tmp/kestrel-bench-llama3-8b"),
                   help="the float checkpoint (written if absent); quantized ones go beside it, '-<scheme>' added")
    p.add_argument("--schemes", default="fp8-static,w8a8-int8", help=f"comma-separated, of {list(SCHEMES)}")
    p.add_argument("--calibration-samples", type=int, default=16)
    p.add_argument("--calibration-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=500)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--latency-output-len", type=int, default=128, help="decode tokens of the batch-1 latency run")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each measuring process")
    p.add_argument("--from-result", type=Path, default=None, help="print and plot this earlier result; run nothing")
    common.add_report_arguments(p)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "quant-checkpoint", "a `kestrel quantize` checkpoint vs quantization at load",
                          add_arguments, run)


def run(args: argparse.Namespace) -> int:
    if args.from_result is not None:
        result = json.loads(args.from_result.read_text())
        common.report(result, summary(result), args.result_file, plot)
        return 0
    schemes = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown or not schemes:
        raise ConfigError(f"invalid --schemes={args.schemes!r}: expected a comma-separated list of {list(SCHEMES)}")
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        with tempfile.TemporaryDirectory() as tmp:
            args.weights_dir = Path(tmp) / "float"
            return _run(args, schemes, torch.device("cpu"))
    return _run(args, schemes, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def _run(args: argparse.Namespace, schemes: list[str], device: torch.device) -> int:
    started = time.perf_counter()
    if args.smoke:
        write_tiny_checkpoint(args.weights_dir, "llama", "tiny", **common.SMOKE_OVERRIDES)
    else:
        common.write_random_checkpoint(args.weights_dir, common.ARCHS[args.arch], device)
    float_dir = str(args.weights_dir)
    prepared = {"float_checkpoint_s": time.perf_counter() - started}
    vocab = common.prompt_vocab(float_dir)
    samples = common.random_prompts(args.calibration_samples, args.calibration_len, vocab, seed=7)
    checkpoints: dict[str, dict[str, Any]] = {}
    for scheme in schemes:
        out_dir = Path(f"{args.weights_dir}-{scheme}")
        options = QuantizeOptions(scheme, num_samples=args.calibration_samples, seq_len=args.calibration_len)
        began = time.perf_counter()
        if _has_quantized(out_dir, options):
            quant_summary: dict[str, Any] = {"reused": True}
        else:
            common.log(f"kestrel quantize {scheme} -> {out_dir}")
            quant_summary = quantize_checkpoint(float_dir, out_dir, options, samples, device=device.type,
                                                model=model_skeleton(load_hf_config(float_dir)))
        checkpoints[scheme] = {"dir": str(out_dir), "quantize_s": time.perf_counter() - began, **quant_summary}
    common.release(None)  # the calibration model's memory, before the measuring processes size their KV caches
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "suite": "quant-checkpoint",
        "config": {"arch": None if args.smoke else args.arch, "smoke": args.smoke, "schemes": schemes,
                   "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                   "max_num_seqs": args.max_num_seqs, "latency_batch": 1, "latency_input_len": 128,
                   "latency_output_len": args.latency_output_len, "kv_cache_dtype": "auto",
                   "calibration": f"{args.calibration_samples} random sequences of {args.calibration_len} tokens"},
        "environment": common.environment(device), "prepare": prepared, "checkpoints": checkpoints,
        "rows": rows, "comparison": [], "targets": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in schemes:
            for path in ("at load", "checkpoint"):
                model_args = (["--model", float_dir, "--quantization", ONLINE_FLAG[scheme]] if path == "at load"
                              else ["--model", checkpoints[scheme]["dir"]])
                common.log(f"{scheme}, {path}: throughput, then batch-1 latency")
                row = {"scheme": scheme, "path": path,
                       **_measure(args, model_args, device, Path(tmp) / f"{scheme}-{path.replace(' ', '-')}")}
                rows.append(row)
                common.write_result(result, args.result_file, quiet=True)
    result["comparison"] = compare(rows, schemes)
    result["targets"] = evaluate_targets(result["comparison"], args.smoke)
    common.report(result, summary(result), args.result_file, plot)
    return 0


def _has_quantized(out_dir: Path, options: QuantizeOptions) -> bool:
    config_file = out_dir / "config.json"
    return (config_file.is_file() and any(out_dir.glob("*.safetensors"))
            and json.loads(config_file.read_text()).get("quantization_config") == quantization_config(options))


def _measure(args: argparse.Namespace, model_args: list[str], device: torch.device, stem: Path) -> dict[str, Any]:
    """Throughput and batch-1 latency of one model path, each suite in its own process."""
    engine = ["--dtype", "float32" if args.smoke else "bfloat16", "--max-num-batched-tokens",
              "64" if args.smoke else "8192"]
    throughput = _suite(["throughput", *model_args, *engine, "--num-prompts", str(args.num_prompts),
                         "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                         "--max-num-seqs", str(args.max_num_seqs), "--hf-peer-prompts", "0",
                         "--max-seconds", str(args.timeout * 0.6)], stem.with_suffix(".throughput.json"), args.timeout)
    latency = _suite(["latency", *model_args, *engine, "--batch", "1", "--input-len", "128" if not args.smoke else "8",
                      "--output-len", str(args.latency_output_len), "--repeats", "1" if args.smoke else "3",
                      "--hf-peer", "none", "--no-checks"], stem.with_suffix(".latency.json"), args.timeout)
    row: dict[str, Any] = {}
    if "error" in throughput:
        row["throughput_error"] = throughput["error"]
    else:
        stats = throughput["kestrel"]
        row.update(output_tok_per_s=stats["output_tok_per_s"], truncated=stats["truncated"],
                   engine_build_s=throughput["engine_build_s"],
                   startup_to_first_token_s=throughput["startup_to_first_token_s"],
                   kv_cache_blocks=throughput["config"]["kv_cache_blocks"], precision=throughput["config"]["precision"])
    if "error" in latency:
        row["latency_error"] = latency["error"]
    else:
        point = latency["rows"][0]
        row.update(decode_ms_per_token=point["decode_ms_per_token"], ttft_ms=point["ttft_ms"],
                   latency_engine_build_s=latency["startup_s"], weight_bytes=latency["weight_bytes"]["total"])
    return row


def _suite(argv: list[str], result_file: Path, timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, "-m", f"kestrel.bench.{argv[0]}", *argv[1:], "--result-file", str(result_file)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"{argv[0]} timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not result_file.is_file():
        return {"error": f"{argv[0]} exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(result_file.read_text())


def compare(rows: list[dict[str, Any]], schemes: list[str]) -> list[dict[str, Any]]:
    """Per scheme: the checkpoint's throughput, batch-1 decode and engine build relative to quantization at load."""
    out = []
    for scheme in schemes:
        by_path = {r["path"]: r for r in rows if r["scheme"] == scheme}
        load, ckpt = by_path.get("at load", {}), by_path.get("checkpoint", {})
        entry: dict[str, Any] = {"scheme": scheme}
        if "output_tok_per_s" in load and "output_tok_per_s" in ckpt:
            entry["throughput_ratio"] = ckpt["output_tok_per_s"] / load["output_tok_per_s"]
            entry["engine_build_saved_s"] = load["engine_build_s"] - ckpt["engine_build_s"]
            entry["engine_build_ratio"] = ckpt["engine_build_s"] / load["engine_build_s"]
        if "decode_ms_per_token" in load and "decode_ms_per_token" in ckpt:
            entry["decode_latency_ratio"] = ckpt["decode_ms_per_token"] / load["decode_ms_per_token"]
            entry["ttft_ratio"] = ckpt["ttft_ms"] / load["ttft_ms"]
        out.append(entry)
    return out


def evaluate_targets(comparison: list[dict[str, Any]], smoke: bool) -> list[dict[str, Any]]:
    if smoke:
        return []
    targets = []
    for c in comparison:
        s = c["scheme"]
        for key, what, limit, ok in (
                ("throughput_ratio", "output tok/s >= 97% of quantization at load", THROUGHPUT_MIN_RATIO,
                 lambda v: v >= THROUGHPUT_MIN_RATIO),
                ("decode_latency_ratio", "batch-1 decode ms/token <= 103% of quantization at load",
                 LATENCY_MAX_RATIO, lambda v: v <= LATENCY_MAX_RATIO),
                ("engine_build_ratio", "engine build faster than quantization at load", 1.0, lambda v: v < 1.0)):
            measured = c.get(key)
            targets.append({"target": f"{s}: {what}", "limit": limit, "measured": measured,
                            "pass": measured is not None and ok(measured)})
    return targets


def summary(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"quant-checkpoint: throughput {cfg['num_prompts']} x {cfg['input_len']}/{cfg['output_len']} at "
             f"max_num_seqs {cfg['max_num_seqs']}; batch-1 decode of {cfg['latency_output_len']} tokens",
             f"{'scheme':18}{'path':12}{'out tok/s':>11}{'ms/token':>10}{'TTFT ms':>9}{'build s':>9}"]
    def num(row: dict[str, Any], key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    for r in result["rows"]:
        lines.append(f"{r['scheme']:18}{r['path']:12}{num(r, 'output_tok_per_s', '11.1f'):>11}"
                     f"{num(r, 'decode_ms_per_token', '10.3f'):>10}{num(r, 'ttft_ms', '9.1f'):>9}"
                     f"{num(r, 'engine_build_s', '9.1f'):>9}")
        for key in ("throughput_error", "latency_error"):
            if key in r:
                lines.append(f"  {key}: {r[key][-400:]}")
    return "\n".join(lines + common.target_lines(result["targets"], ".3f"))


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    schemes = result["config"]["schemes"]
    panels = (("output_tok_per_s", "output tokens / s"), ("decode_ms_per_token", "batch-1 decode ms / token"),
              ("engine_build_s", "engine build s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4))
    width = 0.38
    for ax, (key, label) in zip(axes, panels):
        for offset, (path_name, color) in enumerate((("at load", "tab:gray"), ("checkpoint", "tab:blue"))):
            values = [next((r.get(key, 0.0) for r in result["rows"] if r["scheme"] == s and r["path"] == path_name),
                           0.0) for s in schemes]
            xs = [i + (offset - 0.5) * width for i in range(len(schemes))]
            ax.bar(xs, values, width, color=color, label=f"quantized {path_name}")
        ax.set_xticks(range(len(schemes)), schemes)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"kestrel quantize checkpoint vs quantization at load, {cfg['arch']} "
                 f"({result['environment'].get('gpu')})", fontsize=10)
    return common.save_figure(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("quant-checkpoint", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
