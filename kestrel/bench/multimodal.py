"""`kestrel bench multimodal`: image TTFT split into encoder and decoder prefill, and throughput with one image per
request, on random-weight LLaVA-1.5-7B- and Qwen2.5-VL-7B-shaped checkpoints (`kestrel.bench.vl_checkpoints`, written
to /tmp/kestrel-bench-ARCH on the device and reused).

TTFT, per image size: one request with one random square image and `--text-tokens` random text tokens (max_tokens 1,
prefix caching off), from handing the PIL image and token ids to the checkpoint's processor (as the server does after
decoding the upload) to the step that returns the first token; median of `--repeats` runs after `--warmups`, each run
with an image never seen before. Split:
- `preprocess_ms`: the processor on the host (resize, normalize, placeholder expansion);
- `engine_ttft_ms`: from adding the request to its first token (encoder step + prefill + sampling);
- `decoder_prefill_ms`: the engine TTFT of the same image again right after (new text tokens): its encoder output
  comes from the engine's encoder cache, so this is the decoder prefill step alone (the engine's encoder-item
  counter checks that the first run encoded the image and the second did not);
- `encoder_ms`: the model's vision tower + projector (`embed_multimodal`, pixels to projected rows) timed on its own
  with CUDA events (host clock on the CPU), median of `--repeats` after one warm-up; `encoder_by_difference_ms` =
  engine TTFT minus the cached one, as a cross-check.

Throughput: `--num-requests` requests, each with its own image (`--throughput-image-size`), `--text-tokens` text
tokens and `--output-len` greedy output tokens (ignore_eos), all added at once after a short warm-up; output tokens /
s and requests / s over the timed run. The images are preprocessed before the clock starts (reported apart).
Target (issue 32): image TTFT (336x336 + 64 tokens, 7B) <= 60 ms, for each model, on `ttft_ms` (processor included).
`--smoke` runs the same path on the CPU with tiny checkpoints of every architecture here (`--arch` also takes
`qwen2-vl-7b`, Qwen2-VL-7B's shape).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from kestrel.bench import common, register_suite, standalone_main, vl_checkpoints
from kestrel.config import ConfigError
from kestrel.entrypoints.media import MediaProcessor
from kestrel.sampling_params import SamplingParams

TTFT_LIMIT_MS = 60.0
TARGET_IMAGE_SIZE = 336
TARGET_TEXT_TOKENS = 64
MAX_MODEL_LEN = 4096
SMOKE = {"image_sizes": "40,96", "repeats": 2, "warmups": 1, "num_requests": 6, "output_len": 6,
         "throughput_image_size": 56, "max_num_seqs": 4, "max_num_batched_tokens": 128}
# Image seeds of the phases, far apart so that no two runs share an image (and its encoder cache entry).
WARMUP_SEED, TTFT_SEED, THROUGHPUT_SEED = 1_000_000, 2_000_000, 3_000_000


def random_image(seed: int, size: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


class Harness:
    """One model's engine, its processor and the prompt layout: image placeholder (between Qwen's vision markers)
    first, then the text tokens."""

    def __init__(self, model_dir: str, args: argparse.Namespace, device: torch.device) -> None:
        started = time.perf_counter()
        engine = common.build_engine(
            model_dir, dtype=args.dtype, device=device.type, enable_prefix_caching=False,
            enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=min(MAX_MODEL_LEN, model_max_len(model_dir)))
        modalities = frozenset(getattr(engine.runner, "supported_modalities", ()))
        if "image" not in modalities:
            raise ConfigError(f"invalid model={model_dir!r}: not a model that takes images")
        # The server's processor: the same pixel tensors, placeholder expansion and content hashes as a served request.
        self.media = MediaProcessor(engine.config.model, modalities, engine.core.tokenizer)
        self.core, self.runner, self.config = engine.core, engine.runner, engine.config
        self.device = device
        self.build_s = time.perf_counter() - started
        hf = self.config.model.hf_config
        image = self.media.image_token_id
        start, end = hf.get("vision_start_token_id"), hf.get("vision_end_token_id")
        self.image_prefix = [start, image, end] if start is not None and end is not None else [image]
        self.vocab = text_vocab(model_dir)
        self.counter = 0

    @property
    def items_encoded(self) -> int:
        return self.runner.media_encoder.num_items_encoded

    def prompt(self, image: Image.Image, text_tokens: int, seed: int) -> tuple[list[int], tuple[Any, ...]]:
        text = common.random_prompts(1, text_tokens, self.vocab, seed)[0]
        return self.media.expand(self.image_prefix + text, [image], "multi_modal_data")

    def first_token(self, image: Image.Image, text_tokens: int, seed: int) -> dict[str, float]:
        """One request to its first token: seconds of preprocessing, of the engine, and prompt / image tokens."""
        common.synchronize(self.device)
        start = time.perf_counter()
        ids, items = self.prompt(image, text_tokens, seed)
        prepared = time.perf_counter()
        self.counter += 1
        request_id = f"ttft-{self.counter}"
        self.core.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                              media=items)
        first = None
        while self.core.has_unfinished_requests():
            for out in self.core.step():
                if out.request_id == request_id and out.outputs[0].token_ids and first is None:
                    first = time.perf_counter()
        if first is None:
            raise RuntimeError(f"{request_id}: no token came back")
        return {"total_s": first - start, "preprocess_s": prepared - start, "engine_s": first - prepared,
                "prompt_tokens": len(ids), "image_tokens": items[0].num_embeds, "data": items[0].data}

    def cold_and_cached(self, image: Image.Image, text_tokens: int, seed: int) -> tuple[dict, dict]:
        """The image's first request (encoded) and a second one with it (encoder output from the cache)."""
        before = self.items_encoded
        cold = self.first_token(image, text_tokens, seed)
        middle = self.items_encoded
        cached = self.first_token(image, text_tokens, seed + 1)
        if middle - before != 1 or self.items_encoded != middle:
            raise RuntimeError(f"expected one image encoded then none (the second from the encoder cache); the "
                               f"encoder ran on {middle - before} then {self.items_encoded - middle}")
        return cold, cached

    def time_encoder(self, data: Any, repeats: int) -> float:
        """Median seconds of the vision tower + projector on one image's processor output, pixels on the host."""
        model = self.runner.model
        with torch.inference_mode():
            model.embed_multimodal("image", [data])
            samples = []
            for _ in range(repeats):
                if self.device.type == "cuda":
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize(self.device)
                    begin.record()
                    model.embed_multimodal("image", [data])
                    end.record()
                    torch.cuda.synchronize(self.device)
                    samples.append(begin.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    model.embed_multimodal("image", [data])
                    samples.append(time.perf_counter() - t0)
        return common.median(samples)

    def release(self) -> None:
        del self.core, self.runner, self.media
        common.release(None)


def text_config(model_dir: str) -> dict[str, Any]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config)


def model_max_len(model_dir: str) -> int:
    return int(text_config(model_dir)["max_position_embeddings"])


def text_vocab(model_dir: str) -> int:
    """Random text tokens are drawn below this: the tokenizer's words, never its special (image) tokens."""
    words = len(json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"])
    return min(words, int(text_config(model_dir)["vocab_size"]))


def measure_ttft(h: Harness, size: int, text_tokens: int, repeats: int, warmups: int) -> dict[str, Any]:
    for w in range(warmups):
        h.cold_and_cached(random_image(WARMUP_SEED + 1000 * size + w, size), text_tokens, WARMUP_SEED + 10 * w)
    runs = [h.cold_and_cached(random_image(TTFT_SEED + 1000 * size + r, size), text_tokens, TTFT_SEED + 10 * r)
            for r in range(repeats)]
    cold = [c for c, _ in runs]
    cached = [c for _, c in runs]
    ms = lambda values: 1e3 * common.median(values)  # noqa: E731
    row = {"image_size": size, "text_tokens": text_tokens, "prompt_tokens": cold[0]["prompt_tokens"],
           "image_tokens": cold[0]["image_tokens"], "repeats": repeats,
           "ttft_ms": ms([c["total_s"] for c in cold]), "preprocess_ms": ms([c["preprocess_s"] for c in cold]),
           "engine_ttft_ms": ms([c["engine_s"] for c in cold]),
           "decoder_prefill_ms": ms([c["engine_s"] for c in cached]),
           "encoder_ms": 1e3 * h.time_encoder(cold[-1]["data"], repeats)}
    row["encoder_by_difference_ms"] = row["engine_ttft_ms"] - row["decoder_prefill_ms"]
    return row


def measure_throughput(h: Harness, args: argparse.Namespace) -> dict[str, Any]:
    size, n = args.throughput_image_size, args.num_requests
    warm = min(n, args.max_num_seqs)
    run_requests(h, [h.prompt(random_image(WARMUP_SEED + 500_000 + i, size), args.text_tokens, WARMUP_SEED + i)
                     for i in range(warm)], min(args.output_len, 8), "warm")
    started = time.perf_counter()
    prompts = [h.prompt(random_image(THROUGHPUT_SEED + i, size), args.text_tokens, THROUGHPUT_SEED + i)
               for i in range(n)]
    preprocess_s = time.perf_counter() - started
    before = h.items_encoded
    run = run_requests(h, prompts, args.output_len, "run")
    if h.items_encoded - before < n:  # more when a chunked image was evicted between its chunks
        raise RuntimeError(f"{n} distinct images, only {h.items_encoded - before} encoded")
    return {"image_size": size, "num_requests": n, "text_tokens": args.text_tokens, "output_len": args.output_len,
            "preprocess_s": preprocess_s, **run, "requests_per_s": n / run["elapsed_s"],
            "output_tok_per_s": run["output_tokens"] / run["elapsed_s"],
            "total_tok_per_s": (run["output_tokens"] + run["prompt_tokens"]) / run["elapsed_s"]}


def run_requests(h: Harness, prompts: list[tuple[list[int], tuple[Any, ...]]], output_len: int,
                 tag: str) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind="final_only")
    common.synchronize(h.device)
    start = time.perf_counter()
    for i, (ids, items) in enumerate(prompts):
        h.core.add_request(f"{tag}-{i}", ids, params, media=items)
    output_tokens = finished = steps = 0
    while h.core.has_unfinished_requests():
        steps += 1
        for out in h.core.step():
            if out.finished:
                finished += 1
                output_tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    if finished != len(prompts) or output_tokens != len(prompts) * output_len:
        raise RuntimeError(f"{tag}: {finished}/{len(prompts)} requests finished with {output_tokens} output tokens; "
                           f"expected {len(prompts) * output_len}")
    return {"elapsed_s": elapsed, "output_tokens": output_tokens, "steps": steps,
            "prompt_tokens": sum(len(ids) for ids, _ in prompts)}


def measured(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The models that ran to the end (a failed one holds its error alone)."""
    return [m for m in models if "error" not in m]


def evaluate_targets(models: list[dict[str, Any]], smoke: bool) -> list[dict[str, Any]]:
    targets = []
    for m in measured(models):
        row = next((r for r in m["rows"] if r["image_size"] == TARGET_IMAGE_SIZE
                    and r["text_tokens"] == TARGET_TEXT_TOKENS), None)
        if row is None or smoke:
            continue
        targets.append({"target": f"image TTFT ({TARGET_IMAGE_SIZE}x{TARGET_IMAGE_SIZE} + {TARGET_TEXT_TOKENS} "
                                  f"tokens, 7B) <= {TTFT_LIMIT_MS:.0f} ms: {m['arch']}",
                        "limit": TTFT_LIMIT_MS, "measured": row["ttft_ms"], "pass": row["ttft_ms"] <= TTFT_LIMIT_MS})
    return targets


def summary(result: dict[str, Any]) -> str:
    lines = [f"multimodal ({result['environment'].get('gpu')}): TTFT ms, medians; encoder = vision tower + projector, "
             "decoder prefill = TTFT with the encoder output cached",
             f"{'model':15}{'image':>6}{'tokens':>7}{'TTFT':>8}{'preproc':>8}{'engine':>8}{'encoder':>8}"
             f"{'dec.prefill':>12}{'enc.diff':>9}"]
    for m in measured(result["models"]):
        for r in m["rows"]:
            lines.append(f"{m['arch']:15}{r['image_size']:>6}{r['prompt_tokens']:>7}{r['ttft_ms']:8.2f}"
                         f"{r['preprocess_ms']:8.2f}{r['engine_ttft_ms']:8.2f}{r['encoder_ms']:8.2f}"
                         f"{r['decoder_prefill_ms']:12.2f}{r['encoder_by_difference_ms']:9.2f}")
    for m in result["models"]:
        if "error" in m:
            lines.append(f"{m['arch']:15} FAILED: {m['error']}")
            continue
        t = m["throughput"]
        lines.append(f"{m['arch']:15} throughput {t['num_requests']} x ({t['image_size']}px image + {t['text_tokens']} "
                     f"text / {t['output_len']} out): {t['output_tok_per_s']:.1f} out tok/s, "
                     f"{t['requests_per_s']:.2f} req/s (preprocessing {t['preprocess_s']:.2f} s apart)")
    return "\n".join(lines + common.target_lines(result["targets"], ".2f"))


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    models = measured(result["models"])
    if not models:
        return False
    rows = [(m["arch"], r) for m in models for r in m["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(9, 1.4 * len(rows) + 5), 4.5),
                                      gridspec_kw={"width_ratios": [2, 1]})
    x = list(range(len(rows)))
    series = [("TTFT", "ttft_ms"), ("preprocess", "preprocess_ms"), ("encoder", "encoder_ms"),
              ("decoder prefill (encoder cached)", "decoder_prefill_ms")]
    width = 0.8 / len(series)
    for j, (label, key) in enumerate(series):
        left.bar([i + (j - (len(series) - 1) / 2) * width for i in x], [r[key] for _, r in rows], width, label=label)
    if not result["config"]["smoke"]:
        left.axhline(TTFT_LIMIT_MS, linestyle="--", linewidth=1, color="tab:red", label="target (336 px)")
    left.set_xticks(x, [f"{arch}\n{r['image_size']} px, {r['prompt_tokens']} tok" for arch, r in rows], fontsize=7)
    left.set_ylabel("ms")
    left.set_title("one request, one image + text, to the first token", fontsize=9)
    left.legend(fontsize=7)
    names = [m["arch"] for m in models]
    right.bar(names, [m["throughput"]["output_tok_per_s"] for m in models], color="tab:blue")
    for i, m in enumerate(models):
        right.annotate(f"{m['throughput']['requests_per_s']:.2f} req/s", (i, m["throughput"]["output_tok_per_s"]),
                       ha="center", va="bottom", fontsize=8)
    right.set_ylabel("output tokens / s")
    t0 = models[0]["throughput"]
    right.set_title(f"{t0['num_requests']} requests, 1 image each, {t0['output_len']} out", fontsize=9)
    right.tick_params(axis="x", labelsize=7)
    smoke = ", tiny smoke checkpoints" if result["config"]["smoke"] else ""
    fig.suptitle(f"kestrel multimodal ({result['environment'].get('gpu')}{smoke})")
    return common.save_figure(plt, fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="llava-1.5-7b,qwen2.5-vl-7b",
                   help=f"comma-separated, of {', '.join(vl_checkpoints.SHAPES)}")
    p.add_argument("--weights-dir", type=Path, default=None,
                   help="parent of the random checkpoints, one ARCH folder each (reused if present; default "
                        "/tmp/kestrel-bench-ARCH)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--image-sizes", default="336,1024", help="comma-separated square image sizes (pixels) for TTFT")
    p.add_argument("--text-tokens", type=int, default=TARGET_TEXT_TOKENS, help="random text tokens beside the image")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=100, help="requests of the throughput run (one image each)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of each throughput request")
    p.add_argument("--throughput-image-size", type=int, default=336)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for the decode steps")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous one's tokens reach the host (default: on for a GPU)")
    common.add_report_arguments(p)


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "multimodal", "image TTFT (encoder vs decoder prefill) and throughput of "
                          "vision-language models", add_arguments, run)


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = [a for a in archs if a not in vl_checkpoints.SHAPES]
    if not archs or unknown:
        raise ConfigError(f"invalid --arch={args.arch!r}: expected a comma-separated list of "
                          f"{', '.join(vl_checkpoints.SHAPES)}")
    try:
        sizes = [int(s) for s in args.image_sizes.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"invalid --image-sizes={args.image_sizes!r}: expected comma-separated pixel sizes")
    for name in ("text_tokens", "repeats", "num_requests", "output_len", "throughput_image_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"invalid --{name.replace('_', '-')}={getattr(args, name)}: expected at least 1")
    if args.warmups < 0:
        raise ConfigError(f"invalid --warmups={args.warmups}: expected 0 or more")
    return archs, sizes


def apply_smoke(args: argparse.Namespace, dtype: str = "float32") -> None:
    """The smoke run's sizes (tiny checkpoints of every architecture)."""
    for key, value in SMOKE.items():
        setattr(args, key, value)
    args.smoke, args.dtype, args.arch = True, dtype, ",".join(vl_checkpoints.SHAPES)


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        apply_smoke(args)
        with tempfile.TemporaryDirectory() as tmp:
            args.weights_dir = Path(tmp)
            return _run(args, torch.device("cpu"))
    return _run(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def measure_model(arch: str, args: argparse.Namespace, sizes: list[int], device: torch.device) -> dict[str, Any]:
    started = time.perf_counter()
    path = (args.weights_dir / arch) if args.weights_dir else common.default_weights_dir(arch)
    vl_checkpoints.write_checkpoint(path, arch, device, getattr(torch, args.dtype), tiny=args.smoke)
    checkpoint_s = time.perf_counter() - started
    common.log(f"{arch}: checkpoint {path} ready in {checkpoint_s:.1f} s")
    h = Harness(str(path), args, device)
    try:
        common.log(f"{arch}: engine built in {h.build_s:.1f} s; KV cache {h.runner.num_blocks} blocks")
        rows = []
        for size in sizes:
            rows.append(measure_ttft(h, size, args.text_tokens, args.repeats, args.warmups))
            common.log(f"{arch} {size} px: TTFT {rows[-1]['ttft_ms']:.2f} ms (encoder {rows[-1]['encoder_ms']:.2f})")
        throughput = measure_throughput(h, args)
        return {"arch": arch, "model": str(path), "checkpoint_s": checkpoint_s, "engine_build_s": h.build_s,
                "kv_cache_blocks": h.runner.num_blocks, "async_scheduling": h.core.async_scheduling,
                "weight_bytes": common.weight_bytes(h.runner.model)["total"], "rows": rows, "throughput": throughput}
    finally:
        h.release()


def _run(args: argparse.Namespace, device: torch.device) -> int:
    archs, sizes = check_arguments(args)
    result: dict[str, Any] = {
        "suite": "multimodal",
        "config": {"archs": archs, "image_sizes": sizes, "text_tokens": args.text_tokens, "repeats": args.repeats,
                   "warmups": args.warmups, "num_requests": args.num_requests, "output_len": args.output_len,
                   "throughput_image_size": args.throughput_image_size, "dtype": args.dtype,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "enforce_eager": args.enforce_eager, "smoke": args.smoke,
                   "ttft_method": "encoder: embed_multimodal timed alone (CUDA events); decoder prefill: TTFT of the "
                                  "same image again, its encoder output from the encoder cache"},
        "environment": common.environment(device), "models": [],
    }
    for arch in archs:
        try:
            result["models"].append(measure_model(arch, args, sizes, device))
        except Exception as e:  # recorded, and the next architecture still runs (one device job measures both)
            common.log(f"{arch} failed:\n{traceback.format_exc()}")
            result["models"].append({"arch": arch, "error": f"{type(e).__name__}: {e}"})
            common.release(None)
        # written after each model, so a job killed in the second keeps the first
        common.write_result({**result, "targets": evaluate_targets(result["models"], args.smoke)}, args.result_file,
                            quiet=True)
    result["targets"] = evaluate_targets(result["models"], args.smoke)
    common.report(result, summary(result), args.result_file, plot)
    return 1 if any("error" in m for m in result["models"]) else 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("multimodal", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
