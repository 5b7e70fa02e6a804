"""The offline quantizer behind `kestrel quantize`: calibration, SmoothQuant, per-channel weights, static scales,
written as a compressed-tensors checkpoint that `QuantPlan` (and compressed-tensors itself) loads.

Calibration runs the float model (transformers, float32, CPU or GPU) on token sequences and records, for every
linear layer, the absolute maximum of each input channel, and for every attention layer the absolute maximum of
its keys and values. SmoothQuant (alpha in [0, 1]) then moves activation outliers into the weights where an
RMSNorm feeds the layer: per input channel j, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) over the layers the
norm feeds (q, k, v; gate, up); W[:, j] *= s_j and the norm's weight /= s_j, so the float model computes the same
function. Weights are quantized per output channel (absmax / 448 for FP8, / 127 for INT8); static input scales
are the calibrated per-tensor absmax (after smoothing) / 448 or / 127; FP8 KV scales are the keys' and values'
absmax / 448 (the keys' bound taken before RoPE, times sqrt 2, which bounds any rotated pair).
"""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kestrel.config import ConfigError
from kestrel.kernels.quant_act import FP8_MAX, SCALE_FLOOR
from kestrel.quant.w8a8_fp8 import quantize_weight_fp8
from kestrel.quant.w8a8_int8 import INT8_SYM_MAX, quantize_weight_int8

SCHEMES = ("fp8-dynamic", "fp8-static", "w8a8-int8", "w8a8-int8-static")
NORM_FEEDS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
_COPIED = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
           "merges.txt", "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class QuantizeOptions:
    scheme: str
    smoothquant: float | None = None  # alpha; None: no smoothing
    kv_cache_fp8: bool = False
    num_samples: int = 64
    seq_len: int = 256
    weight_strategy: str = "channel"  # or "tensor": one weight scale per linear module

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"invalid scheme={self.scheme!r}: expected one of {list(SCHEMES)}")
        if self.weight_strategy not in ("channel", "tensor"):
            raise ConfigError(f"invalid weight_strategy={self.weight_strategy!r}: expected 'channel' or 'tensor'")
        if self.smoothquant is not None and not 0.0 <= self.smoothquant <= 1.0:
            raise ConfigError(f"invalid smoothquant={self.smoothquant!r}: alpha must be in [0, 1]")
        if self.num_samples < 1 or self.seq_len < 2:
            raise ConfigError("invalid calibration size: need at least 1 sample of at least 2 tokens")

    @property
    def fp8(self) -> bool:
        return self.scheme.startswith("fp8")

    @property
    def static(self) -> bool:
        return self.scheme in ("fp8-static", "w8a8-int8-static")

    @property
    def needs_calibration(self) -> bool:
        return self.static or self.smoothquant is not None or self.kv_cache_fp8


@dataclass
class Calibration:
    """Per linear layer, each input channel's absmax; per attention layer, key and value absmax."""

    input_absmax: dict[str, torch.Tensor]
    key_absmax: dict[int, float]
    value_absmax: dict[int, float]


def calibrate(model: torch.nn.Module, samples: Iterable[list[int]], device: torch.device) -> Calibration:
    inputs: dict[str, torch.Tensor] = {}
    keys: dict[int, float] = defaultdict(float)
    values: dict[int, float] = defaultdict(float)
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            def record(_m, args, name=name):
                amax = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
                inputs[name] = amax if name not in inputs else torch.maximum(inputs[name], amax)
            hooks.append(module.register_forward_pre_hook(record))
            for proj, store in (("k_proj", keys), ("v_proj", values)):
                if name.endswith("self_attn." + proj):
                    layer = int(name.split(".layers.")[1].split(".")[0])

                    def kv(_m, _args, out, layer=layer, store=store):
                        store[layer] = max(store[layer], float(out.detach().abs().max()))
                    hooks.append(module.register_forward_hook(kv))
    try:
        with torch.no_grad():
            for ids in samples:
                model(torch.tensor([ids], device=device))
    finally:
        for h in hooks:
            h.remove()
    return Calibration(inputs, dict(keys), dict(values))


def smooth(weights: dict[str, torch.Tensor], calibration: Calibration, alpha: float, num_layers: int) -> None:
    """SmoothQuant in place on the checkpoint tensors; the calibrated input absmax is divided by the same s."""
    for i in range(num_layers):
        for norm, fed in NORM_FEEDS.items():
            names = [f"model.layers.{i}.{f}" for f in fed]
            act = calibration.input_absmax[names[0]].clamp_min(1e-5)
            w_max = torch.stack([weights[n + ".weight"].float().abs().amax(0) for n in names]).amax(0).clamp_min(1e-5)
            s = (act.pow(alpha) / w_max.pow(1.0 - alpha)).clamp_min(1e-5)
            norm_key = f"model.layers.{i}.{norm}.weight"
            dtype = weights[norm_key].dtype
            weights[norm_key] = (weights[norm_key].float() / s).to(dtype)
            for n in names:
                weights[n + ".weight"] = (weights[n + ".weight"].float() * s).to(weights[n + ".weight"].dtype)
                calibration.input_absmax[n] = calibration.input_absmax[n] / s


def quantize_weight(weight: torch.Tensor, fp8: bool, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit weight and its fp32 scale: `[N, 1]` per output channel (the quantizers of quantization at load), or
    `[1]` for the whole tensor (the same quantizer over the tensor as one row)."""
    quantize = quantize_weight_fp8 if fp8 else quantize_weight_int8
    if not per_tensor:
        return quantize(weight)
    q, scale = quantize(weight.reshape(1, -1))
    return q.reshape(weight.shape), scale.reshape(1)


def quantization_config(options: QuantizeOptions) -> dict:
    kind = "float" if options.fp8 else "int"

    def args(strategy: str, dynamic: bool) -> dict:
        return {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                "observer_kwargs": {}}

    config = {
        "quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": f"{kind}-quantized", "output_activations": None,
            "weights": args(options.weight_strategy, False),
            "input_activations": args("tensor", False) if options.static else args("token", True)}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
        "global_compression_ratio": None,
    }
    if options.kv_cache_fp8:
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True, "group_size": None, "block_structure": None,
                                     "actorder": None, "observer": None, "observer_kwargs": {}}
    return config


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, options: QuantizeOptions,
                        samples: list[list[int]] | None = None, device: str = "cpu",
                        progress: Callable[[Iterable], Iterable] = lambda x: x) -> dict:
    """Write `out_dir`; returns a summary of the scales chosen."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    src, dst = Path(model_dir), Path(out_dir)
    hf_config = json.loads((src / "config.json").read_text())
    if hf_config.get("quantization_config"):
        raise ConfigError(f"invalid model={str(src)!r}: it is already quantized (quantization_config); quantize "
                          "the original weights")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"invalid model={str(src)!r}: no *.safetensors weights to quantize")
    weights = {name: t for f in files for name, t in load_file(str(f)).items()}
    calibration = Calibration({}, {}, {})
    dev = torch.device(device)
    if options.needs_calibration:
        if not samples:
            raise ConfigError(f"invalid calibration: scheme {options.scheme!r} with smoothquant={options.smoothquant} "
                              f"and kv_cache_fp8={options.kv_cache_fp8} needs calibration samples")
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(dev).eval()
        calibration = calibrate(model, progress(samples), dev)
        del model
    num_layers = int(hf_config["num_hidden_layers"])
    if options.smoothquant is not None:
        smooth(weights, calibration, options.smoothquant, num_layers)
    out: dict[str, torch.Tensor] = {}
    qmax = FP8_MAX if options.fp8 else INT8_SYM_MAX
    input_scales = []
    for name, tensor in progress(list(weights.items())):
        module = name[: -len(".weight")]
        if name.endswith(".weight") and module.endswith("_proj") and ".layers." in name:
            q, scale = quantize_weight(tensor.to(dev), options.fp8, options.weight_strategy == "tensor")
            out[name], out[module + ".weight_scale"] = q.cpu(), scale.cpu()
            if options.static:
                scale = float(calibration.input_absmax[module].max()) / qmax
                out[module + ".input_scale"] = torch.tensor([max(scale, SCALE_FLOOR)], dtype=torch.float32)
                input_scales.append(scale)
        else:
            out[name] = tensor.contiguous()
    if options.kv_cache_fp8:
        for i in range(num_layers):
            out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(
                max(calibration.key_absmax[i] * math.sqrt(2.0) / FP8_MAX, SCALE_FLOOR))
            out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(
                max(calibration.value_absmax[i] / FP8_MAX, SCALE_FLOOR))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    hf_config["quantization_config"] = quantization_config(options)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return {"scheme": options.scheme, "smoothquant": options.smoothquant, "kv_cache_fp8": options.kv_cache_fp8,
            "calibration_samples": len(samples or []), "linear_layers": sum(1 for k in out if k.endswith("_scale")
                                                                            and "weight_scale" in k),
            "input_scale_range": [min(input_scales), max(input_scales)] if input_scales else None}
