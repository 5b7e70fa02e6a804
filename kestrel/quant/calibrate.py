"""The offline quantizer behind `kestrel quantize`: calibration, SmoothQuant, per-channel weights, static scales,
written as a compressed-tensors checkpoint that `QuantPlan` (and compressed-tensors itself) loads.

What to quantize comes from the checkpoint's kestrel model (`QuantTargets.of_model`, built on the meta device:
only its structure is read), never from a family's naming: its linear layers (the modules holding a
`QuantMethod`), unpacked into checkpoint modules by the model's `packed_modules_mapping`, and its attention
modules (the parent of the linear layer with the "k" and "v" shards), whose FP8 KV scales are written under the
names the compressed-tensors scheme reads.

Calibration runs the float model (transformers, float32, CPU or GPU) on token sequences and records, for every
quantized linear layer, the absolute maximum of each input channel, and for every attention module the absolute
maximum of its keys and values. SmoothQuant (alpha in [0, 1]) then moves activation outliers into the weights
where a norm feeds linear layers directly: per input channel j, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) over
the layers the norm feeds (q, k, v; gate, up); W[:, j] *= s_j and the norm's weight /= s_j, so the float model
computes the same function. Which norm feeds which layers is observed in the calibration forward (a linear
layer's input is the very tensor a module returned), and a module counts as such a norm when scaling its weight
scales its output exactly (y = normalize(x) * weight; not `1 + weight` norms, not ones with a bias). Weights are
quantized per output channel (absmax / 448 for FP8, / 127 for INT8); static input scales are the calibrated
per-tensor absmax (after smoothing) / 448 or / 127; FP8 KV scales are the keys' and values' absmax / 448 (the
keys' bound taken before RoPE, times sqrt 2, which bounds any rotated pair).

The weight-only schemes (w4a16, w8a16: `kestrel.quant.weight_only`) quantize the same targets to 4- or 8-bit
integer groups by RTN, AWQ-style scaling or GPTQ; the last two calibrate one decoder layer at a time on this
float model (`calibrate(..., hessians=True)`: each linear module's x x^T and mean |x|), its earlier layers replaced
by their quantized weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.kernels.quant_act import FP8_MAX, SCALE_FLOOR
from kestrel.quant.awq_search import foldable_linear_pairs
from kestrel.quant.base import FusedMoEMethod, QuantMethod
from kestrel.quant.schemes.compressed_tensors import CompressedTensorsScheme
from kestrel.quant.w8a8_fp8 import quantize_weight_fp8
from kestrel.quant.w8a8_int8 import INT8_SYM_MAX, quantize_weight_int8
from kestrel.quant.weight_only import (
    ALGORITHMS,
    DEFAULT_DAMPENING,
    DEFAULT_GROUP_SIZE,
    LayerStats,
    WeightOnlyPlan,
    quantize_weights,
)

SCHEMES = ("fp8-dynamic", "fp8-static", "w8a8-int8", "w8a8-int8-static", "w4a16", "w8a16")
# Weight-only schemes -> bits (`kestrel.quant.weight_only`).
WEIGHT_ONLY_BITS = {"w4a16": 4, "w8a16": 8}
# The settings of the weight-only schemes, None when not given (the command line's flags are these fields).
WEIGHT_ONLY_FIELDS = ("group_size", "algorithm", "symmetric", "act_order", "dampening")


def _weight_only_field(help_text: str, **extra: Any) -> Any:
    return field(default=None, metadata={"help": help_text, **extra})
# Left out of the written config's `Linear` target: the LM head, under the name Hugging Face causal LMs give it
# (kestrel runs it in the model dtype, and `QuantPlan.check_unquantized` refuses a checkpoint that quantizes it).
UNQUANTIZED_MODULES = ("lm_head",)
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
    group_size: int | None = _weight_only_field(
        f"w4a16 / w8a16: input features per weight scale, -1 for one per output channel (default "
        f"{DEFAULT_GROUP_SIZE})")
    algorithm: str | None = _weight_only_field(
        "w4a16 / w8a16: rtn (round to nearest, default), awq (activation-aware scales folded into the norm or "
        "linear layer before) or gptq (Hessian-based error compensation); awq and gptq calibrate", choices=ALGORITHMS)
    symmetric: bool | None = _weight_only_field("w4a16 / w8a16: symmetric integers (default), or zero points")
    act_order: bool | None = _weight_only_field("gptq: quantize columns by decreasing input energy, the groups "
                                                "staying contiguous (no g_idx; default on, as llm-compressor's "
                                                "actorder 'static')")
    dampening: float | None = _weight_only_field(f"gptq: fraction of the Hessian's mean diagonal added to it "
                                                 f"(default {DEFAULT_DAMPENING})")

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"invalid scheme={self.scheme!r}: expected one of {list(SCHEMES)}")
        given = [name for name in WEIGHT_ONLY_FIELDS if getattr(self, name) is not None]
        if self.scheme in WEIGHT_ONLY_BITS:
            if self.smoothquant is not None:
                raise ConfigError(f"invalid smoothquant={self.smoothquant} with scheme={self.scheme!r}: SmoothQuant "
                                  "moves outliers for 8-bit activations; a weight-only scheme quantizes none (use "
                                  "algorithm='awq' for activation-aware weight scales)")
            if self.weight_strategy != "channel":
                raise ConfigError(f"invalid weight_strategy={self.weight_strategy!r} with scheme={self.scheme!r}: "
                                  "weight-only schemes take group_size (-1: per channel)")
            if self.algorithm != "gptq" and self.dampening is not None:
                raise ConfigError(f"invalid dampening={self.dampening} with algorithm={self.algorithm or 'rtn'!r}: "
                                  "dampening is GPTQ's; use algorithm='gptq'")
            self.weight_only  # noqa: B018 - validates the plan
        elif given:
            raise ConfigError(f"invalid {', '.join(f'{n}={getattr(self, n)!r}' for n in given)} with "
                              f"scheme={self.scheme!r}: these settings are the weight-only schemes' "
                              f"({list(WEIGHT_ONLY_BITS)})")
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
    def weight_only(self) -> WeightOnlyPlan | None:
        """The weight-only settings (their defaults filled in), or None for a W8A8 scheme."""
        if self.scheme not in WEIGHT_ONLY_BITS:
            return None
        return WeightOnlyPlan(WEIGHT_ONLY_BITS[self.scheme],
                              DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size,
                              True if self.symmetric is None else self.symmetric, self.algorithm or "rtn",
                              self.algorithm == "gptq" if self.act_order is None else self.act_order,
                              DEFAULT_DAMPENING if self.dampening is None else self.dampening)

    @property
    def needs_calibration(self) -> bool:
        plan = self.weight_only
        return (self.static or self.smoothquant is not None or self.kv_cache_fp8
                or (plan is not None and plan.needs_calibration))


@dataclass(frozen=True)
class AttentionTarget:
    """An attention module by checkpoint names: the module (its KV scales are named after it) and the linear
    modules whose outputs are its keys and values (before RoPE)."""

    prefix: str
    key: str
    value: str


@dataclass(frozen=True)
class QuantTargets:
    """The checkpoint modules the quantizer touches."""

    linears: tuple[str, ...]  # quantized linear modules (each has `<name>.weight`)
    attention: tuple[AttentionTarget, ...]

    @classmethod
    def of_model(cls, model: nn.Module) -> QuantTargets:
        """From a kestrel model (any device; the meta device costs no memory): every module holding a
        `quant_method` is a linear layer, its checkpoint modules given by `type(model).packed_modules_mapping`
        (merged name -> part names in shard order); the linear layer with shards "k" and "v" is its parent
        attention module's key and value projection."""
        packed: Mapping[str, Sequence[str]] | None = getattr(type(model), "packed_modules_mapping", None)
        if packed is None:
            raise ConfigError(f"invalid model: {type(model).__name__} declares no packed_modules_mapping (merged "
                              "layer name -> the checkpoint modules it is made of; {} when nothing is merged)")
        linears: list[str] = []
        attention: list[AttentionTarget] = []
        for name, module in model.named_modules():
            if isinstance(getattr(module, "quant_method", None), FusedMoEMethod):
                raise ConfigError(f"invalid model: {type(model).__name__} has mixture-of-experts layers ({name}), "
                                  "which `kestrel quantize` does not quantize yet; serve it with quantization='fp8' "
                                  "(experts and linear layers quantized at load) or load an FP8 checkpoint written by "
                                  "llm-compressor")
            if not isinstance(getattr(module, "quant_method", None), QuantMethod):
                continue
            parts = checkpoint_modules(name, packed)
            linears.extend(parts)
            shard_ids = list(getattr(module, "shard_ids", ()))
            if "k" in shard_ids and "v" in shard_ids:
                if len(parts) != len(shard_ids):
                    raise ValueError(f"{type(model).__name__}.packed_modules_mapping gives {name} {len(parts)} "
                                     f"checkpoint modules for its {len(shard_ids)} shards {shard_ids}")
                attention.append(AttentionTarget(name.rpartition(".")[0], parts[shard_ids.index("k")],
                                                 parts[shard_ids.index("v")]))
        return cls(tuple(linears), tuple(attention))


def checkpoint_modules(linear_name: str, packed: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The checkpoint modules a kestrel linear layer is made of: its parts when `packed` maps its name (e.g.
    "...self_attn.qkv_proj" -> q_proj, k_proj, v_proj under the same parent), else the layer itself."""
    parent, _, leaf = linear_name.rpartition(".")
    parts = packed.get(leaf)
    if not parts:
        return (linear_name,)
    return tuple(f"{parent}.{part}" if parent else part for part in parts)


@dataclass
class Calibration:
    """Per linear module, each input channel's absmax; per attention module (its prefix), key and value absmax;
    the norms that feed linear modules directly, with the modules each feeds (SmoothQuant's pairs)."""

    input_absmax: dict[str, torch.Tensor]
    key_absmax: dict[str, float]
    value_absmax: dict[str, float]
    norm_feeds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # With `hessians`: per linear module, sum of x x^T over its inputs `[K, K]` and each input channel's mean |x|;
    # the modules reading one tensor (q, k, v) share these objects.
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    input_absmean: dict[str, torch.Tensor] = field(default_factory=dict)


class _InputStats:
    """x x^T and |x| sums per distinct linear input: the first module to read a tensor in a forward owns its sums,
    the others reading the very same tensor share them."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}
        self.xtx: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = defaultdict(int)
        self.seen: dict[int, tuple[weakref.ref, str]] = {}

    def add(self, name: str, x: torch.Tensor) -> None:
        known = self.seen.get(id(x))
        if known is not None and known[0]() is x:
            self.owner[name] = known[1]
            return
        self.seen[id(x)] = (weakref.ref(x), name)
        self.owner[name] = name
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        if name not in self.xtx:
            self.xtx[name] = torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float32, device=x2.device)
            self.abs_sum[name] = torch.zeros(x2.shape[1], dtype=torch.float32, device=x2.device)
        self.xtx[name].addmm_(x2.T, x2)
        self.abs_sum[name] += x2.abs().sum(0)
        self.rows[name] += x2.shape[0]

    def results(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        means = {name: self.abs_sum[name] / max(self.rows[name], 1) for name in self.xtx}
        return ({name: self.xtx[owner] for name, owner in self.owner.items()},
                {name: means[owner] for name, owner in self.owner.items()})


def calibrate(model: nn.Module, samples: Iterable[list[int]], device: torch.device,
              targets: QuantTargets, hessians: bool = False) -> Calibration:
    """Run the float model (`model`: transformers, its module names the checkpoint's) over `samples`; with
    `hessians`, also each linear module's input statistics (GPTQ's Hessian, AWQ's mean magnitudes)."""
    modules = dict(model.named_modules())
    wanted = [*targets.linears, *(n for a in targets.attention for n in (a.key, a.value))]
    absent = [name for name in wanted if name not in modules]
    if absent:
        raise ConfigError(f"invalid model: the float model has no modules {absent[:5]} that kestrel's model maps "
                          "to checkpoint modules")
    inputs: dict[str, torch.Tensor] = {}
    keys: dict[str, float] = defaultdict(float)
    values: dict[str, float] = defaultdict(float)
    feeds = _FeedRecorder(model, targets.linears)
    stats = _InputStats() if hessians else None
    hooks = []
    for name in targets.linears:
        def record(_m, args, name=name):
            amax = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            inputs[name] = amax if name not in inputs else torch.maximum(inputs[name], amax)
            if stats is not None:
                stats.add(name, args[0])
        hooks.append(modules[name].register_forward_pre_hook(record))
    for target in targets.attention:
        for proj, store in ((target.key, keys), (target.value, values)):
            def kv(_m, _args, out, prefix=target.prefix, store=store):
                store[prefix] = max(store[prefix], float(out.detach().abs().max()))
            hooks.append(modules[proj].register_forward_hook(kv))
    try:
        with torch.no_grad():
            for i, ids in enumerate(samples):
                with feeds.recording(i == 0):
                    model(torch.tensor([ids], device=device))
    finally:
        for h in hooks:
            h.remove()
    xtx, absmean = stats.results() if stats is not None else ({}, {})
    return Calibration(inputs, dict(keys), dict(values), feeds.norm_feeds(), xtx, absmean)


class _FeedRecorder:
    """Which module's output each linear module (`nn.Linear`) takes as its input, seen in one forward: the module
    that returned that very tensor (the innermost one, when an outer module returns it too)."""

    def __init__(self, model: nn.Module, targets: Sequence[str]) -> None:
        self.modules = dict(model.named_modules())
        self.targets = set(targets)
        self.fed_by: dict[str, str] = {}

    @contextlib.contextmanager
    def recording(self, active: bool) -> Iterator[None]:
        if not active:
            yield
            return
        outputs: dict[int, tuple[weakref.ref, str]] = {}

        def produced(_m, _args, out, name):
            if not isinstance(out, torch.Tensor):
                return
            known = outputs.get(id(out))
            # An id seen before belongs to this tensor only while that tensor lives (ids are reused).
            if known is None or known[0]() is not out:
                outputs[id(out)] = (weakref.ref(out), name)

        def consumed(_m, args, name):
            source = outputs.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
            if source is not None and source[0]() is args[0]:
                self.fed_by.setdefault(name, source[1])

        hooks = []
        for name, module in self.modules.items():
            if name:
                hooks.append(module.register_forward_hook(partial(produced, name=name)))
            if isinstance(module, nn.Linear):
                hooks.append(module.register_forward_pre_hook(partial(consumed, name=name)))
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def norm_feeds(self) -> dict[str, tuple[str, ...]]:
        """norm module -> the linear modules it feeds, for each producer whose every linear consumer is quantized
        and that scales its output exactly with its weight (the norm's output is assumed to feed nothing else, as
        in a pre-norm block)."""
        consumers: dict[str, list[str]] = {}
        for linear, producer in self.fed_by.items():
            consumers.setdefault(producer, []).append(linear)
        return {producer: tuple(fed) for producer, fed in consumers.items()
                if all(name in self.targets for name in fed) and _scales_with_weight(self.modules[producer])}


def _scales_with_weight(module: nn.Module) -> bool:
    """True for a module whose only parameter is a per-channel `weight` that multiplies its output: doubling the
    weight doubles the output exactly (an RMSNorm; not a `1 + weight` norm, not one with a bias)."""
    params = list(module.parameters())
    weight = getattr(module, "weight", None)
    if len(params) != 1 or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    x = torch.randn(2, weight.numel(), generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.no_grad():
        out = module(x)
        weight.mul_(2)
        try:
            doubled = module(x)
        finally:
            weight.div_(2)
    return isinstance(out, torch.Tensor) and torch.equal(doubled, out * 2)


def smooth(weights: dict[str, torch.Tensor], calibration: Calibration, alpha: float) -> None:
    """SmoothQuant in place on the checkpoint tensors; the calibrated input absmax is divided by the same s."""
    if not calibration.norm_feeds:
        raise ConfigError("invalid smoothquant: the calibration found no norm feeding linear layers directly, so "
                          "there is nothing to smooth into")
    for norm, names in calibration.norm_feeds.items():
        act = calibration.input_absmax[names[0]].clamp_min(1e-5)
        w_max = torch.stack([weights[n + ".weight"].float().abs().amax(0) for n in names]).amax(0).clamp_min(1e-5)
        s = (act.pow(alpha) / w_max.pow(1.0 - alpha)).clamp_min(1e-5)
        norm_key = f"{norm}.weight"
        dtype = weights[norm_key].dtype
        weights[norm_key] = (weights[norm_key].float() / s).to(dtype)
        for n in names:
            weights[n + ".weight"] = (weights[n + ".weight"].float() * s).to(weights[n + ".weight"].dtype)
            calibration.input_absmax[n] = calibration.input_absmax[n] / s


def _layer_calibration(model: nn.Module, samples: list[list[int]], device: torch.device, awq: bool,
                       linears: Sequence[str]) -> tuple[Callable, Callable]:
    """The weight-only quantizer's callbacks on the float model (`kestrel.quant.weight_only.quantize_weights`):
    statistics of some linear modules from a calibration forward, and tensors put back into the model."""
    pairs: dict[str, str] = {}
    if awq:  # found on the float model, before any weight changes
        pairs = foldable_linear_pairs(model, linears, torch.tensor([samples[0][:32]], device=device),
                                      lambda ids: model(ids).logits)

    def collect(names: Sequence[str]) -> LayerStats:
        found = calibrate(model, samples, device, QuantTargets(tuple(names), ()), hessians=True)
        local = {p: c for p, c in pairs.items() if p in names and c in names}
        return LayerStats(found.hessians, found.input_absmean, found.norm_feeds, local)

    def update(tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in tensors.items():
                param = model.get_parameter(name)
                param.copy_(tensor.to(param.device, param.dtype))

    return collect, update


def quantize_weight(weight: torch.Tensor, fp8: bool, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit weight and its fp32 scale: `[N, 1]` per output channel (the quantizers of quantization at load), or
    `[1]` for the whole tensor (the same quantizer over the tensor as one row)."""
    quantize = quantize_weight_fp8 if fp8 else quantize_weight_int8
    if not per_tensor:
        return quantize(weight)
    q, scale = quantize(weight.reshape(1, -1))
    return q.reshape(weight.shape), scale.reshape(1)


def quantization_config(options: QuantizeOptions) -> dict:
    plan = options.weight_only
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
        "ignore": list(UNQUANTIZED_MODULES), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
        "global_compression_ratio": None,
    }
    if plan is not None:
        config["format"] = "pack-quantized"
        config["config_groups"] = {"group_0": plan.quantization_config()}
    if options.kv_cache_fp8:
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True, "group_size": None, "block_structure": None,
                                     "actorder": None, "observer": None, "observer_kwargs": {}}
    return config


# The files of a checkpoint's weights, which an overwritten output directory loses before the new ones are written.
CHECKPOINT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "pytorch_model.bin.index.json")


def check_output_dir(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse, before anything is read or written, an output directory that would destroy the model's weights (the
    model's own directory, `overwrite` or not) or mix with another checkpoint (not empty, unless `overwrite`)."""
    if dst.resolve() == src.resolve():
        raise ConfigError(f"invalid out={str(dst)!r}: it is the model's own directory, and the quantized checkpoint "
                          "would overwrite the weights it is made from; write it to a directory of its own")
    if dst.exists() and not dst.is_dir():
        raise ConfigError(f"invalid out={str(dst)!r}: it is a file; give a directory")
    present = sorted(path.name for path in dst.iterdir()) if dst.is_dir() else []
    if present and not overwrite:
        shown = ", ".join(present[:5]) + (" and more" if len(present) > 5 else "")
        raise ConfigError(f"invalid out={str(dst)!r}: the directory is not empty ({shown}); its files would mix "
                          "with the new checkpoint's (a stale shard index would win): give a new or empty directory, "
                          "or --overwrite to replace the checkpoint files in it")


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, options: QuantizeOptions,
                        samples: list[list[int]] | None = None, device: str = "cpu",
                        progress: Callable[[Iterable], Iterable] = lambda x: x, *, model: nn.Module,
                        overwrite: bool = False) -> dict:
    """Write `out_dir`; returns a summary of the scales chosen. `model`: the checkpoint's kestrel model, whose
    structure says what to quantize (`QuantTargets.of_model`; build it on the meta device). `overwrite`: a
    non-empty `out_dir` is allowed, its checkpoint files replaced (`check_output_dir`)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    src, dst = Path(model_dir), Path(out_dir)
    check_output_dir(src, dst, overwrite)
    hf_config = json.loads((src / "config.json").read_text())
    if hf_config.get("quantization_config"):
        raise ConfigError(f"invalid model={str(src)!r}: it is already quantized (quantization_config); quantize "
                          "the original weights")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"invalid model={str(src)!r}: no *.safetensors weights to quantize")
    weights = {name: t for f in files for name, t in load_file(str(f)).items()}
    targets = QuantTargets.of_model(model)
    absent = [name for name in targets.linears if name + ".weight" not in weights]
    if absent:
        raise ConfigError(f"invalid model={str(src)!r}: the checkpoint has no weights for the linear modules "
                          f"{absent[:5]}{' and more' if len(absent) > 5 else ''} of {type(model).__name__}")
    calibration = Calibration({}, {}, {})
    dev = torch.device(device)
    plan = options.weight_only
    float_model = None
    if options.needs_calibration:
        if not samples:
            algorithm = f", algorithm={plan.algorithm!r}" if plan is not None else ""
            raise ConfigError(f"invalid calibration: scheme {options.scheme!r} with smoothquant={options.smoothquant}"
                              f"{algorithm} and kv_cache_fp8={options.kv_cache_fp8} needs calibration samples")
        float_model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(dev).eval()
        if plan is None or options.kv_cache_fp8:
            calibration = calibrate(float_model, progress(samples), dev, targets)
    if options.smoothquant is not None:
        smooth(weights, calibration, options.smoothquant)
    out: dict[str, torch.Tensor] = {}
    qmax = FP8_MAX if options.fp8 else INT8_SYM_MAX
    input_scales = []
    quantized = set(targets.linears)
    summary: dict[str, Any] = {}
    if plan is not None:
        collect = update = None
        if plan.needs_calibration:
            collect, update = _layer_calibration(float_model, samples, dev, plan.algorithm == "awq", targets.linears)
        out, summary = quantize_weights(weights, targets.linears, plan, dev, collect, update)
    del float_model
    for name, tensor in progress(list(weights.items()) if plan is None else []):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            q, scale = quantize_weight(tensor.to(dev), options.fp8, options.weight_strategy == "tensor")
            out[name], out[module + ".weight_scale"] = q.cpu(), scale.cpu()
            if options.static:
                scale = float(calibration.input_absmax[module].max()) / qmax
                out[module + ".input_scale"] = torch.tensor([max(scale, SCALE_FLOOR)], dtype=torch.float32)
                input_scales.append(scale)
        else:
            out[name] = tensor.contiguous()
    if options.kv_cache_fp8:
        for attention in targets.attention:
            key_name, value_name = CompressedTensorsScheme.kv_scale_names.written(attention.prefix)
            out[key_name] = torch.tensor(
                max(calibration.key_absmax[attention.prefix] * math.sqrt(2.0) / FP8_MAX, SCALE_FLOOR))
            out[value_name] = torch.tensor(max(calibration.value_absmax[attention.prefix] / FP8_MAX, SCALE_FLOOR))
    dst.mkdir(parents=True, exist_ok=True)
    for stale in CHECKPOINT_FILES:  # --overwrite: an earlier checkpoint's shards and index would win over ours
        for path in dst.glob(stale):
            path.unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    hf_config["quantization_config"] = quantization_config(options)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    result = {"scheme": options.scheme, "smoothquant": options.smoothquant, "kv_cache_fp8": options.kv_cache_fp8,
              "calibration_samples": len(samples or []), "linear_layers": sum(1 for k in out if k.endswith("_scale")
                                                                              and "weight_scale" in k),
              "input_scale_range": [min(input_scales), max(input_scales)] if input_scales else None}
    if plan is not None:
        result.update(algorithm=plan.algorithm, group_size=plan.group_size, symmetric=plan.symmetric,
                      act_order=plan.act_order, **summary)
    return result
