"""`kestrel bench ppl --quant-sweep`: held-out perplexity of each quantization against the float model.

Two base models: the bundled kestrel-tiny, and an outlier-injected copy of it: in every decoder layer a few
RMSNorm channels are scaled up by s (a power of two, so exactly) and the input columns of the linear layers they
feed (q, k, v; gate, up) down by 1/s. The float model computes the same function, but its activations carry the
large outlier channels that real LLMs have and that per-token INT8 handles worst. For each base, every variant
is written by `kestrel quantize` (compressed-tensors) and scored by the same perplexity evaluation: FP8 dynamic,
FP8 static (per-channel weights; per-tensor weights with each merged shard's scale kept, and re-quantized to
one scale per merged GEMM), INT8 (dynamic per-token) without smoothing and with SmoothQuant, weight-only W4A16
(groups of 128, symmetric) by RTN, AWQ-style scaling and GPTQ, and the float model with an FP8 KV cache under
calibrated and under unit scales. JSON + a bar chart of each variant's perplexity
relative to its base's float model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kestrel.config import ConfigError
from kestrel.loader.hf_config import load_hf_config
from kestrel.model.registry import model_skeleton
from kestrel.quant.calibrate import QuantizeOptions, quantize_checkpoint
from kestrel.tiny import corpus

# kestrel-tiny (a Llama): each decoder layer's norms and the projections each one feeds.
NORM_FEEDS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}

OUTLIER_CHANNELS = (7, 61, 130, 201)
OUTLIER_SCALE = 32.0
# name -> (scheme, SmoothQuant alpha, KV cache) written by `kestrel quantize`; None: the float model itself.
# "-tensor": one weight scale per module; "-requantized": then one per merged GEMM (q/k/v, gate/up share the
# largest, weights re-rounded), what a kernel taking a single weight scale needs; kestrel keeps each shard's.
VARIANTS: dict[str, tuple[str | None, float | None, str]] = {
    "float": (None, None, "auto"),
    "fp8-dynamic": ("fp8-dynamic", None, "auto"),
    "fp8-static": ("fp8-static", None, "auto"),
    "fp8-static-tensor": ("fp8-static", None, "auto"),
    "fp8-static-tensor-requantized": ("fp8-static", None, "auto"),
    "int8": ("w8a8-int8", None, "auto"),
    "int8-smoothquant": ("w8a8-int8", 0.5, "auto"),
    "w4a16-rtn": ("w4a16", None, "auto"),
    "w4a16-awq": ("w4a16", None, "auto"),
    "w4a16-gptq": ("w4a16", None, "auto"),
    "fp8-kv-calibrated": (None, None, "fp8-calibrated"),
    "fp8-kv-unit": (None, None, "fp8-unit"),
    "gguf-q8_0": ("gguf", None, "auto"),
    "gguf-q8_0-dequantized": ("gguf", None, "auto"),
    "gguf-q4_k": ("gguf", None, "auto"),
    "gguf-q4_k-dequantized": ("gguf", None, "auto"),
}
# GGUF files written from the base (`quant/gguf_export.py`, every 2-D tensor in the type; Q4_K's rows that are not a
# multiple of 256 in its fallback Q5_0). "-dequantized": the float model holding gguf's own dequantization of that
# file, the oracle the GGUF row must match to float tolerance.
GGUF_TYPES = {"gguf-q8_0": "Q8_0", "gguf-q8_0-dequantized": "Q8_0", "gguf-q4_k": "Q4_K",
              "gguf-q4_k-dequantized": "Q4_K"}
GGUF_MATCH = 1e-4
# The weight-only variants' algorithm (`kestrel quantize --scheme w4a16 --algorithm A --group-size 128`).
W4A16_ALGORITHMS = {"w4a16-rtn": "rtn", "w4a16-awq": "awq", "w4a16-gptq": "gptq"}
W4A16_GROUP = 128
# Issue targets: perplexity within these fractions of the float model's.
TARGETS = {"fp8-dynamic": 0.01, "fp8-static": 0.01, "int8-smoothquant": 0.02, "fp8-kv-calibrated": 0.005,
           "w4a16-awq": 0.03, "w4a16-gptq": 0.03, "gguf-q8_0": 0.005}
# Targets set on one base only (the others hold on both).
TARGET_BASES = {"int8-smoothquant": "kestrel-tiny-outliers", "w4a16-awq": "kestrel-tiny", "w4a16-gptq": "kestrel-tiny"}


def inject_outliers(src: Path, dst: Path, channels: tuple[int, ...] = OUTLIER_CHANNELS,
                    scale: float = OUTLIER_SCALE) -> Path:
    """A copy of the checkpoint with the same function and outlier activation channels."""
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    tensors = {name: t for f in files for name, t in load_file(str(f)).items()}
    num_layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    idx = torch.tensor(channels)
    for i in range(num_layers):
        for norm, fed in NORM_FEEDS.items():
            tensors[f"model.layers.{i}.{norm}.weight"][idx] *= scale
            for f in fed:
                tensors[f"model.layers.{i}.{f}.weight"][:, idx] /= scale
    for f in files:
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def requantize_fused_shards(path: Path) -> None:
    """Give the per-tensor FP8 shards of each merged GEMM one scale (their largest), re-rounding the weights."""
    tensors = load_file(str(path / "model.safetensors"))
    num_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    for i in range(num_layers):
        for fed in NORM_FEEDS.values():
            names = [f"model.layers.{i}.{f}" for f in fed]
            shared = max(float(tensors[n + ".weight_scale"]) for n in names)
            for n in names:
                w = tensors[n + ".weight"].float() * tensors[n + ".weight_scale"].float()
                tensors[n + ".weight"] = (w / shared).clamp(-448, 448).to(torch.float8_e4m3fn)
                tensors[n + ".weight_scale"] = torch.tensor([shared], dtype=torch.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def selected_variants(spec: str | None) -> set[str] | None:
    """The variants `--variants` names, with the float model every row is set against; None (all) without it."""
    if spec is None:
        return None
    names = {name.strip() for name in spec.split(",") if name.strip()}
    if not names:
        raise ConfigError(f"--variants {spec!r} names no variant; expected some of {', '.join(VARIANTS)}")
    unknown = sorted(names - set(VARIANTS))
    if unknown:
        raise ConfigError(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")
    return {"float", *names}


def write_gguf_variant(base: Path, dst: Path, type_name: str, dequantized: bool) -> Path:
    """`base` as a GGUF file of `type_name` (dst.gguf); with `dequantized`, also that file's weights as gguf's
    dequantizer reads them, written as a float checkpoint beside the base's config and tokenizer (dst/)."""
    from kestrel.quant import gguf_export

    tensors = {name: t for f in sorted(base.glob("*.safetensors")) for name, t in load_file(str(f)).items()}
    path = gguf_export.write_gguf(dst.with_suffix(".gguf"), base,
                                  ((name, t.float().numpy()) for name, t in tensors.items()), lambda name: type_name)
    if not dequantized:
        return path
    config = json.loads((base / "config.json").read_text())
    shutil.copytree(base, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    weights = {name: torch.from_numpy(v) for name, v in gguf_export.dequantized_tensors([path], config).items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def run_sweep(args: Any, score: Any, tokenizer: Any) -> dict[str, Any]:
    """`score(model_dir, **engine_args) -> perplexity result`; returns the sweep's JSON document."""
    from kestrel.tiny import default_model_path

    started = time.perf_counter()
    variants = selected_variants(getattr(args, "variants", None))
    samples = corpus.calibration_token_ids(tokenizer, args.calibration_samples, 256)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bases = {"kestrel-tiny": Path(args.model or default_model_path()),
                 "kestrel-tiny-outliers": inject_outliers(Path(args.model or default_model_path()),
                                                          Path(tmp) / "outliers")}
        for base_name, base in bases.items():
            for variant, (scheme, alpha, kv) in VARIANTS.items():
                if variants is not None and variant not in variants:
                    continue
                model_dir = base
                if variant in GGUF_TYPES:
                    model_dir = write_gguf_variant(base, Path(tmp) / f"{base_name}-{variant}", GGUF_TYPES[variant],
                                                   variant.endswith("-dequantized"))
                elif scheme is not None:
                    model_dir = Path(tmp) / f"{base_name}-{variant}"
                    strategy = "tensor" if "-tensor" in variant else "channel"
                    algorithm = W4A16_ALGORITHMS.get(variant)
                    options = (QuantizeOptions(scheme, algorithm=algorithm, group_size=W4A16_GROUP) if algorithm
                               else QuantizeOptions(scheme, alpha, weight_strategy=strategy))
                    quantize_checkpoint(base, model_dir, options, samples, model=model_skeleton(load_hf_config(base)))
                    if variant.endswith("-requantized"):
                        requantize_fused_shards(model_dir)
                kv_args = {} if kv == "auto" else {"kv_cache_dtype": "fp8"}
                result = score(str(model_dir), calibrate_kv=samples if kv == "fp8-calibrated" else None, **kv_args)
                rows.append({"base": base_name, "variant": variant, "scheme": scheme, "smoothquant": alpha,
                             "algorithm": W4A16_ALGORITHMS.get(variant),
                             "group_size": W4A16_GROUP if variant in W4A16_ALGORITHMS else None,
                             "kv_cache": kv, "perplexity": result["model"]["perplexity"],
                             "bits_per_byte": result["model"]["bits_per_byte"], "tokens": result["tokens"],
                             "files": result["files"], "kv_scales": result.get("kv_scales")})
                print(f"{base_name:>22} {variant:>18}: perplexity {rows[-1]['perplexity']:.4f}", flush=True)
    for row in rows:
        ref = next(r for r in rows if r["base"] == row["base"] and r["variant"] == "float")
        row["vs_float"] = row["perplexity"] / ref["perplexity"] - 1.0
    targets = []
    for row in rows:
        limit = TARGETS.get(row["variant"])
        if limit is None or TARGET_BASES.get(row["variant"], row["base"]) != row["base"]:
            continue
        targets.append({"target": f"{row['variant']} on {row['base']}: perplexity within +{limit:.1%} of float",
                        "limit": limit, "measured": row["vs_float"], "pass": row["vs_float"] <= limit})
    for row in rows:
        oracle = next((r for r in rows if r["base"] == row["base"] and r["variant"] == row["variant"] + "-dequantized"),
                      None)
        if oracle is not None:
            gap = abs(row["perplexity"] / oracle["perplexity"] - 1.0)
            targets.append({"target": f"{row['variant']} on {row['base']}: perplexity equals its gguf-dequantized "
                                      f"float model's within {GGUF_MATCH:g}", "limit": GGUF_MATCH, "measured": gap,
                            "pass": gap <= GGUF_MATCH})
    outl = {r["variant"]: r["vs_float"] for r in rows if r["base"] == "kestrel-tiny-outliers"}
    if "int8" in outl and "int8-smoothquant" in outl:
        targets.append({"target": "INT8 without smoothing clearly worse than with SmoothQuant on the outlier model",
                        "limit": None, "measured": [outl["int8"], outl["int8-smoothquant"]],
                        "pass": outl["int8"] > 2 * max(outl["int8-smoothquant"], 1e-4)})
    return {"suite": "ppl-quant-sweep", "outlier_channels": list(OUTLIER_CHANNELS), "outlier_scale": OUTLIER_SCALE,
            "calibration_samples": len(samples), "rows": rows, "targets": targets,
            "seconds": round(time.perf_counter() - started, 1)}


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    measured = {r["variant"] for r in result["rows"]}
    variants = [v for v in VARIANTS if v != "float" and v in measured]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(variants) + 2.0), 4.5))
    width = 0.38
    for k, base in enumerate(("kestrel-tiny", "kestrel-tiny-outliers")):
        values = [100 * next(r["vs_float"] for r in result["rows"] if r["base"] == base and r["variant"] == v)
                  for v in variants]
        ax.bar([i + (k - 0.5) * width for i in range(len(variants))], values, width, label=base)
    for v, limit in TARGETS.items():
        if v not in variants:
            continue
        i = variants.index(v)
        ax.hlines(100 * limit, i - 0.45, i + 0.45, colors="black", linestyles="dashed", linewidth=1)
    labels = [v.replace("-requantized", "\nrequantized").replace("-dequantized", "\ndequantized") for v in variants]
    ax.set_xticks(range(len(variants)), labels, rotation=15)
    ax.set_ylabel("perplexity vs float model (%)")
    for i, v in enumerate(variants):
        for k, base in enumerate(("kestrel-tiny", "kestrel-tiny-outliers")):
            value = 100 * next(r["vs_float"] for r in result["rows"] if r["base"] == base and r["variant"] == v)
            ax.annotate(f"{value:+.2f}", (i + (k - 0.5) * width, value), ha="center", va="bottom", fontsize=7)
    ax.set_title("Held-out perplexity of each quantization (dashed: target)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
