"""The weight-only branch of `kestrel quantize` (`--scheme w4a16 | w8a16`): every target linear layer's weight to
4- or 8-bit integers per group of input features, by round-to-nearest (`rtn`), AWQ-style activation-aware scaling
then round-to-nearest (`awq`, `kestrel.quant.awq_search`) or GPTQ (`gptq`, `kestrel.quant.gptq_solver`), written
as compressed-tensors `pack-quantized` tensors (`kestrel.quant.int_weights`), the format llm-compressor writes for
its W4A16 / W8A16 schemes and both its loader and kestrel's read.

Calibration (AWQ, GPTQ) goes one decoder layer at a time: a layer's statistics come from the calibration forward
of the model whose earlier layers are already quantized (as llm-compressor's sequential pipeline does), so each
layer's error compensation and scale search see the inputs the quantized model gives it; memory holds one
x x^T per distinct input of one layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kestrel.config import ConfigError
from kestrel.quant.awq_search import search_scales
from kestrel.quant.gptq_solver import gptq
from kestrel.quant.int_weights import IntGrid, check_groups, rtn
from kestrel.quant.wna16 import GROUP_MULTIPLE

ALGORITHMS = ("rtn", "awq", "gptq")
DEFAULT_GROUP_SIZE = 128
DEFAULT_DAMPENING = 0.01
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class WeightOnlyPlan:
    bits: int
    group_size: int = DEFAULT_GROUP_SIZE  # -1: per output channel
    symmetric: bool = True
    algorithm: str = "rtn"
    act_order: bool = False  # GPTQ: columns by decreasing input energy, static groups (no g_idx)
    dampening: float = DEFAULT_DAMPENING  # GPTQ: added to the Hessian's diagonal, times its mean

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"invalid algorithm={self.algorithm!r}: expected one of {list(ALGORITHMS)}")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % GROUP_MULTIPLE):
            raise ConfigError(f"invalid group_size={self.group_size}: expected -1 (per channel) or a positive "
                              f"multiple of {GROUP_MULTIPLE} (the weight-only kernel's K step)")
        if self.act_order and self.algorithm != "gptq":
            raise ConfigError(f"invalid act_order=True with algorithm={self.algorithm!r}: act-order is GPTQ's "
                              "column order; use algorithm='gptq'")
        if not 0.0 < self.dampening < 1.0:
            raise ConfigError(f"invalid dampening={self.dampening}: expected a fraction in (0, 1), e.g. 0.01")

    @property
    def needs_calibration(self) -> bool:
        return self.algorithm != "rtn"

    def grid(self, weight: torch.Tensor) -> IntGrid:
        """Scales are stored in the checkpoint weight's dtype (float32 for other dtypes)."""
        dtype = weight.dtype if weight.dtype in _SCALE_DTYPES else torch.float32
        return IntGrid(self.bits, self.group_size, self.symmetric, dtype)

    def quantization_config(self) -> dict[str, Any]:
        group = self.group_size != -1
        weights = {"num_bits": self.bits, "type": "int", "symmetric": self.symmetric, "dynamic": False,
                   "strategy": "group" if group else "channel", "group_size": self.group_size if group else None,
                   "block_structure": None, "actorder": "static" if self.act_order else None, "observer": None,
                   "observer_kwargs": {}}
        return {"targets": ["Linear"], "format": "pack-quantized", "weights": weights, "input_activations": None,
                "output_activations": None}


@dataclass(frozen=True)
class LayerStats:
    """What the calibration saw (empty for round-to-nearest): per linear module its x x^T sum and mean |x| per
    input channel; the norms feeding linear modules directly; the linear modules whose output rows feed another
    one linearly (producer -> consumer)."""

    hessians: Mapping[str, torch.Tensor]
    input_absmean: Mapping[str, torch.Tensor]
    norm_feeds: Mapping[str, tuple[str, ...]]
    linear_pairs: Mapping[str, str]


def quantize_weights(weights: dict[str, torch.Tensor], linears: Sequence[str], plan: WeightOnlyPlan,
                     device: torch.device, collect: Callable[[Sequence[str]], LayerStats] | None = None,
                     update: Callable[[dict[str, torch.Tensor]], None] | None = None,
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The output checkpoint's tensors (the target modules' `weight` replaced by their pack-quantized tensors,
    AWQ's scaled norms) and a summary.

    AWQ and GPTQ go one decoder layer at a time (`layer_groups`): `collect(linears)` runs the calibration forward
    and returns those modules' statistics, then `update(tensors)` gets what this layer's quantization changed (the
    dequantized weights, AWQ's scaled norms) to put into the float model, so a later layer's statistics are those
    of its inputs in the quantized model, whose errors its own quantization then compensates."""
    for name in linears:
        check_groups(plan.grid(weights[name + ".weight"]), name, weights[name + ".weight"].shape[1])
    if plan.needs_calibration and (collect is None or update is None):
        raise ValueError(f"algorithm {plan.algorithm!r} needs the calibration callbacks")
    work = dict(weights)
    quantized: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for group in layer_groups(linears) if plan.needs_calibration else [list(linears)]:
        stats = collect(group) if collect is not None else LayerStats({}, {}, {}, {})
        absent = [name for name in group if plan.needs_calibration and name not in stats.hessians]
        if absent:
            raise ConfigError(f"invalid calibration: the linear modules {absent[:5]} saw no input in the calibration "
                              f"forward, so {plan.algorithm} has no statistics for them")
        input_scales: dict[str, torch.Tensor] = {}
        changed = _apply_awq(work, plan, stats, device, alphas, input_scales) if plan.algorithm == "awq" else {}
        for name in group:
            weight = work[name + ".weight"].to(device)
            grid = plan.grid(weights[name + ".weight"])
            if plan.algorithm == "gptq":
                layer = gptq(weight, stats.hessians[name].to(device), grid, plan.dampening, plan.act_order)
            elif plan.algorithm == "awq":  # clipping searched on the scaled layer's inputs x / s
                s = input_scales.get(name)
                hessian = stats.hessians[name].to(device)
                layer = rtn(weight, grid, hessian if s is None else hessian / (s[:, None] * s[None, :]))
            else:
                layer = rtn(weight, grid)
            quantized.update({k: v.cpu() for k, v in layer.compressed_tensors(name).items()})
            changed[name + ".weight"] = layer.dequantized()
        if update is not None:
            update(changed)
    replaced = {name + ".weight" for name in linears}
    out = {k: v for k, v in work.items() if k not in replaced}
    for k, v in out.items():  # AWQ's scaled producers were kept in float32 while they were worked on
        if v.is_floating_point() and v.dtype != weights[k].dtype:
            out[k] = v.to(weights[k].dtype)
    out.update(quantized)
    return {k: v.contiguous() for k, v in out.items()}, ({"awq_alpha": alphas} if plan.algorithm == "awq" else {})


def layer_groups(linears: Sequence[str]) -> list[list[str]]:
    """The linear modules by decoder layer, in model order: the name up to its first numeric part
    ("model.layers.3"); a module without one is a group of its own."""
    groups: dict[str, list[str]] = {}
    for name in linears:
        parts = name.split(".")
        cut = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
        groups.setdefault(".".join(parts[:cut + 1]), []).append(name)
    return list(groups.values())


def _apply_awq(work: dict[str, torch.Tensor], plan: WeightOnlyPlan, stats: LayerStats, device: torch.device,
               alphas: dict[str, float], input_scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Search and fold each foldable input's scales into `work` (alphas[producer] = the alpha chosen,
    input_scales[consumer] = s); returns the scaled norms and producer biases."""
    folds = [(norm, tuple(fed), True) for norm, fed in stats.norm_feeds.items()]
    folds += [(producer, (consumer,), False) for producer, consumer in stats.linear_pairs.items()]
    changed = {}
    for producer, consumers, is_norm in folds:
        ws = [work[c + ".weight"].to(device).float() for c in consumers]
        s, alphas[producer] = search_scales(ws, [plan.grid(work[c + ".weight"]) for c in consumers],
                                            stats.hessians[consumers[0]].to(device),
                                            stats.input_absmean[consumers[0]].to(device))
        key = producer + ".weight"
        if is_norm:
            # The norm weight is written in its own dtype: the consumers take the scale its rounding leaves.
            old = work[key].to(device).float()
            new = (old / s).to(work[key].dtype)
            s = torch.where(new != 0, old / new.float(), s)
            work[key] = new.cpu()
            changed[key] = new.float()
        else:
            work[key] = (work[key].to(device).float() / s[:, None]).cpu()
            if producer + ".bias" in work:
                work[producer + ".bias"] = (work[producer + ".bias"].to(device).float() / s).cpu()
                changed[producer + ".bias"] = work[producer + ".bias"]
        for c, w in zip(consumers, ws):
            work[c + ".weight"] = (w * s[None, :]).cpu()
            input_scales[c] = s
    return changed
