"""`kestrel bench whisper`: the real-time factor of Whisper on a random-weight whisper-large-v3-shaped model (32 + 32
layers, d_model 1280, 128 mel bins, 30 s windows; random weights drawn at load, `load_format="dummy"`, with its
config.json, feature extractor and generation_config.json written to /tmp/kestrel-bench-whisper-large-v3).

For each batch size: that many distinct clips of one window each (30 s of noise at 16 kHz), each with Whisper's forced
decoder prompt (`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`) and `--output-len` greedy tokens
(ignore_eos: a 30 s transcript is about 100-150 tokens), all added at once after a warm-up batch. The clock starts
before the feature extraction (the server's path from decoded samples: log-mel features on the host, then the engine:
encoder step, cross-attention K/V, decoder) and stops when the last request finishes. RTF = wall time / audio
seconds (batch x window); below 1 is faster than real time. Feature extraction and engine time are also reported
apart. Target (issue 32): RTF at batch 32 <= 0.01 on the H200. `--smoke` runs the same path on the CPU with a tiny
model of 1 s windows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kestrel.bench import common, register_suite, standalone_main
from kestrel.config import ConfigError
from kestrel.entrypoints.media import Audio, MediaProcessor
from kestrel.sampling_params import SamplingParams

RTF_LIMIT = 0.01
TARGET_BATCH = 32
# whisper-large-v3's shape and special token ids.
LARGE_V3 = {"d_model": 1280, "encoder_layers": 32, "decoder_layers": 32, "encoder_attention_heads": 20,
            "decoder_attention_heads": 20, "encoder_ffn_dim": 5120, "decoder_ffn_dim": 5120, "num_mel_bins": 128,
            "max_source_positions": 1500, "max_target_positions": 448, "vocab_size": 51866, "chunk_length": 30,
            "sot": 50258, "en": 50259, "translate": 50359, "transcribe": 50360, "notimestamps": 50364,
            "eot": 50257}
TINY = {**LARGE_V3, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 16,
        "max_source_positions": 50, "max_target_positions": 64, "chunk_length": 1}
SMOKE = {"batch_sizes": "1,4", "output_len": 8, "repeats": 1}
SAMPLE_RATE = 16000


def write_config(path: Path, shape: dict[str, Any]) -> Path:
    """config.json, preprocessor_config.json and generation_config.json of a Whisper of `shape` (no weights: the
    engine draws them at load)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    keys = ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
            "encoder_ffn_dim", "decoder_ffn_dim", "num_mel_bins", "max_source_positions", "max_target_positions",
            "vocab_size")
    config = transformers.WhisperConfig(**{k: shape[k] for k in keys}, decoder_start_token_id=shape["sot"],
                                        eos_token_id=shape["eot"], pad_token_id=shape["eot"],
                                        bos_token_id=shape["eot"])
    config.architectures = ["WhisperForConditionalGeneration"]
    config.save_pretrained(str(path))
    transformers.WhisperFeatureExtractor(feature_size=shape["num_mel_bins"], sampling_rate=SAMPLE_RATE,
                                         chunk_length=shape["chunk_length"]).save_pretrained(str(path))
    generation = {"decoder_start_token_id": shape["sot"], "eos_token_id": shape["eot"],
                  "no_timestamps_token_id": shape["notimestamps"], "lang_to_id": {"<|en|>": shape["en"]},
                  "task_to_id": {"transcribe": shape["transcribe"], "translate": shape["translate"]}}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return path


class Harness:
    def __init__(self, model_dir: Path, shape: dict[str, Any], args: argparse.Namespace, device: torch.device):
        engine = common.build_engine(
            str(model_dir), load_format="dummy", dtype=args.dtype, device=device.type, enable_prefix_caching=False,
            max_num_seqs=max(args.batch_sizes), gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens)
        self.engine = engine
        self.core, self.runner = engine.core, engine.runner
        self.media = MediaProcessor(engine.config.model, frozenset({"audio"}), engine.core.tokenizer)
        self.prompt = [shape["sot"], shape["en"], shape["transcribe"], shape["notimestamps"]]
        self.window_s = shape["chunk_length"]
        self.device = device
        self.counter = 0

    def run_batch(self, batch: int, output_len: int, seed: int) -> dict[str, float]:
        """`batch` fresh clips of one window each, from samples to the last request's final token."""
        rng = np.random.default_rng(seed)
        clips = [(0.1 * rng.standard_normal(self.window_s * SAMPLE_RATE)).astype(np.float32) for _ in range(batch)]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind="final_only")
        common.synchronize(self.device)
        start = time.perf_counter()
        items = [self.media.expand(self.prompt, [Audio(c, SAMPLE_RATE)], "file")[1] for c in clips]
        featured = time.perf_counter()
        for media in items:
            self.counter += 1
            self.core.add_request(f"w-{self.counter}", self.prompt, params, media=media)
        finished = tokens = 0
        while self.core.has_unfinished_requests():
            for out in self.core.step():
                if out.finished:
                    finished += 1
                    tokens += len(out.outputs[0].token_ids)
        common.synchronize(self.device)
        end = time.perf_counter()
        if finished != batch or tokens != batch * output_len:
            raise RuntimeError(f"batch {batch}: {finished} requests finished with {tokens} tokens; expected "
                               f"{batch * output_len}")
        return {"wall_s": end - start, "features_s": featured - start, "engine_s": end - featured}


def measure(h: Harness, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    h.run_batch(min(batch, 4), min(args.output_len, 8), seed=10_000 + batch)  # warm-up
    runs = [h.run_batch(batch, args.output_len, seed=batch * 100 + r) for r in range(args.repeats)]
    audio_s = batch * h.window_s
    wall = common.median([r["wall_s"] for r in runs])
    return {"batch": batch, "audio_s": audio_s, "output_len": args.output_len, "repeats": args.repeats,
            "wall_s": wall, "features_s": common.median([r["features_s"] for r in runs]),
            "engine_s": common.median([r["engine_s"] for r in runs]), "rtf": wall / audio_s,
            "output_tok_per_s": batch * args.output_len / wall}


def evaluate_targets(rows: list[dict[str, Any]], smoke: bool) -> list[dict[str, Any]]:
    row = next((r for r in rows if r["batch"] == TARGET_BATCH), None)
    if smoke or row is None:
        return []
    return [{"target": f"Whisper-large-v3-shaped RTF at batch {TARGET_BATCH} (30 s clips) <= {RTF_LIMIT}",
             "limit": RTF_LIMIT, "measured": row["rtf"], "pass": row["rtf"] <= RTF_LIMIT}]


def summary(result: dict[str, Any]) -> str:
    lines = [f"whisper ({result['environment'].get('gpu')}, {result['config']['shape']}): real-time factor = wall / "
             "audio seconds, medians",
             f"{'batch':>6}{'audio s':>9}{'wall s':>9}{'features s':>11}{'engine s':>10}{'RTF':>10}{'out tok/s':>11}"]
    for r in result["rows"]:
        lines.append(f"{r['batch']:>6}{r['audio_s']:>9.0f}{r['wall_s']:>9.3f}{r['features_s']:>11.3f}"
                     f"{r['engine_s']:>10.3f}{r['rtf']:>10.5f}{r['output_tok_per_s']:>11.1f}")
    return "\n".join(lines + common.target_lines(result["targets"], ".5f"))


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None or not result["rows"]:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["rows"]
    labels = [str(r["batch"]) for r in rows]
    ax.bar(labels, [r["engine_s"] / r["audio_s"] for r in rows], label="engine (encoder + decoder)")
    ax.bar(labels, [r["features_s"] / r["audio_s"] for r in rows],
           bottom=[r["engine_s"] / r["audio_s"] for r in rows], label="log-mel features (host)")
    if not result["config"]["smoke"]:
        ax.axhline(RTF_LIMIT, linestyle="--", linewidth=1, color="tab:red", label=f"target at batch {TARGET_BATCH}")
    ax.set_xlabel("clips in the batch")
    ax.set_ylabel("real-time factor (wall / audio seconds)")
    ax.legend(fontsize=8)
    smoke = ", tiny smoke model" if result["config"]["smoke"] else ""
    ax.set_title(f"kestrel whisper ({result['environment'].get('gpu')}{smoke}), "
                 f"{result['config']['output_len']} tokens a clip", fontsize=9)
    return common.save_figure(plt, fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated clips per batch")
    p.add_argument("--output-len", type=int, default=128, help="greedy tokens per clip (ignore_eos)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--weights-dir", type=Path, default=None,
                   help="where the config files go (default /tmp/kestrel-bench-whisper-large-v3)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    common.add_report_arguments(p)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "whisper", "Whisper real-time factor (whisper-large-v3 shape, 30 s clips)",
                          add_arguments, run)


def check_arguments(args: argparse.Namespace, shape: dict[str, Any]) -> list[int]:
    try:
        sizes = [int(s) for s in str(args.batch_sizes).split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"invalid --batch-sizes={args.batch_sizes!r}: expected comma-separated positive ints")
    for name in ("output_len", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"invalid --{name.replace('_', '-')}={getattr(args, name)}: expected at least 1")
    if args.output_len + 4 > shape["max_target_positions"]:
        raise ConfigError(f"invalid --output-len={args.output_len}: the decoder holds "
                          f"{shape['max_target_positions']} positions, 4 of them the forced prompt")
    return sizes


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.dtype = "float32"
    shape = TINY if args.smoke else LARGE_V3
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    sizes = check_arguments(args, shape)
    args.batch_sizes = sizes
    path = args.weights_dir or common.default_weights_dir("whisper-large-v3" if not args.smoke else "whisper-tiny")
    write_config(path, shape)
    h = Harness(path, shape, args, device)
    try:
        rows = []
        for batch in sizes:
            rows.append(measure(h, batch, args))
            common.log(f"batch {batch}: RTF {rows[-1]['rtf']:.5f} ({rows[-1]['wall_s']:.3f} s for "
                       f"{rows[-1]['audio_s']} s of audio)")
    finally:
        del h
        common.release(None)
    result = {"suite": "whisper",
              "config": {"shape": "tiny" if args.smoke else "whisper-large-v3", "batch_sizes": sizes,
                         "output_len": args.output_len, "repeats": args.repeats, "dtype": args.dtype,
                         "window_s": shape["chunk_length"], "smoke": args.smoke, "model": str(path),
                         "eager": True},
              "environment": common.environment(device), "rows": rows}
    result["targets"] = evaluate_targets(rows, args.smoke)
    common.report(result, summary(result), args.result_file, plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("whisper", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
