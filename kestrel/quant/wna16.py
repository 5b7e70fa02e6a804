"""Weight-only 4- and 8-bit linear layers (W4A16 / W8A16): checkpoints of GPTQ, AWQ (GEMM) and compressed-tensors
(`pack-quantized`, `int-quantized` without input quantization) run on `ops.wna16_gemm`.

`create_weights` registers the checkpoint's own tensors, as its writer stores them, tagged for the layer's loader,
which then places merged shards (q/k/v, gate/up) and takes a tensor-parallel rank's slice in stored units:

- `gptq`: `qweight` int32 `[K / pf, N]` packed along K; `scales [G, N]`; `qzeros` int32 `[G, N / pf]` packed
  along N (asymmetric; the v1 format stores zero - 1); act-order `g_idx [K]`.
- `awq` (GEMM): `qweight` int32 `[K, N / 8]` packed along N in AWQ's nibble order; `scales [G, N]`; `qzeros` int32
  `[G, N / 8]` likewise.
- `pack-quantized`: `weight_packed` int32 `[N, K / pf]` packed along K; `weight_scale [N, G]`; `weight_zero_point`
  int32 `[N / pf, G]` packed along N (asymmetric); act-order `weight_g_idx [K]`.
- `int-quantized`: `weight` int8 `[N, K]`; `weight_scale [N, G]`; `weight_zero_point [N, G]` (asymmetric);
  act-order `weight_g_idx [K]`.

pf = 32 / bits values per int32; G = K / group_size groups, or 1 per output channel (`group_size` -1). Tensors a
layout may carry but the kernel does not need (GPTQ's `qzeros` of a symmetric checkpoint, a `g_idx` that does not
reorder, compressed-tensors' `weight_shape`) are accepted, checked where that is cheap, and dropped.

Scales load into float32 (exact for any checkpoint dtype) and are kept, after loading, in the narrowest of the
model dtype, float16 and bfloat16 that holds them exactly (float32 otherwise). `process_after_loading` repacks the
loaded tensors with the kestrel.ops helpers into a `WNA16Weight` (`wna16_qweight`, `wna16_scales`, `wna16_zeros`,
`wna16_perm` on the layer) and drops the checkpoint's; `apply` calls `ops.wna16_gemm` on model-dtype input (no
fused producer: `input_quant()` stays None).

Tensor parallelism: a column layer splits N (each rank's share of every merged shard must be whole packed words
where N is packed); a row layer splits K, so each rank's share of the input features must be whole groups (a
ConfigError naming the layer otherwise), per-channel scales stay whole on every rank, and the partial products are
summed (the default row-parallel hooks). Act-order (a `g_idx` that reorders the input features) is refused on a
row-parallel layer with tp > 1: a rank's slice of checkpoint-ordered features holds parts of many groups, which
the kernel's contiguous groups cannot express. The merged parts of a layer (q, k and v see the same input) must
share one act-order permutation, as GPTQ produces them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError
from kestrel.quant.base import QuantMethod

Layout = Literal["gptq", "awq", "pack-quantized", "int-quantized"]
LAYOUTS: tuple[str, ...] = ("gptq", "awq", "pack-quantized", "int-quantized")
BITS = (4, 8)
# The kernel walks K in steps that divide the group: a group (or a whole row, per channel) of 16 features at least.
GROUP_MULTIPLE = 16
_SCALE_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class WNA16Spec:
    """How one linear layer's weight-only checkpoint tensors are stored. Equal specs (the fields compared) are one
    scheme: the merged parts of a layer must have one."""

    layout: Layout
    bits: int
    group_size: int  # -1: one group per output channel (the whole row)
    symmetric: bool
    act_order: bool  # the checkpoint may carry a g_idx that reorders the input features
    zeros_minus_one: bool = False  # GPTQ's v1 format stores each zero point minus one
    # For messages: where the settings come from, and the names of the group-size and act-order settings there.
    source: str = field(default="", compare=False)
    group_field: str = field(default="group_size", compare=False)
    act_order_field: str = field(default="desc_act", compare=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown weight-only layout {self.layout!r}; expected one of {list(LAYOUTS)}")
        if self.bits not in BITS or (self.layout == "awq" and self.bits != 4):
            raise ValueError(f"{self.layout}: {self.bits}-bit weights are not supported")

    @property
    def grouped(self) -> bool:
        return self.group_size > 0

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def name(self) -> str:
        """W4A16 / W8A16, for reports and messages."""
        return f"w{self.bits}a16"


class WNA16LinearMethod(QuantMethod):
    """A weight-only linear layer of one of the `LAYOUTS`; `layer_name` (the checkpoint module, or the merged
    layer's name) is for messages."""

    def __init__(self, spec: WNA16Spec, layer_name: str) -> None:
        self.spec = spec
        self.layer_name = layer_name
        self.weight_type = ""  # the kernel's weight type, known once the checkpoint's tensors are repacked
        self.model_dtype = torch.float32

    # ---------------------------------------------------------------------------------------- loading

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        spec, K, N = self.spec, input_size, sum(output_partition_sizes)
        self._check_shapes(layer, K, output_partition_sizes)
        self.model_dtype = params_dtype
        pf = spec.pack_factor
        G = K // spec.group_size if spec.grouped else 1
        if spec.layout == "gptq":
            register_tagged(layer, "qweight", torch.empty(K // pf, N, dtype=torch.int32), output_dim=1, input_dim=0,
                            packed=(0, pf))
            self._register_scales(layer, "scales", G, N, n_dim=1)
            if spec.symmetric:  # GPTQ writes qzeros for symmetric weights too: accepted, not needed
                _register_ignored(layer, "qzeros")
            else:
                self._register_zeros(layer, "qzeros", G, N // pf, n_dim=1, packed=True)
        elif spec.layout == "awq":
            register_tagged(layer, "qweight", torch.empty(K, N // pf, dtype=torch.int32), output_dim=1, input_dim=0,
                            packed=(1, pf))
            self._register_scales(layer, "scales", G, N, n_dim=1)
            self._register_zeros(layer, "qzeros", G, N // pf, n_dim=1, packed=True)
        else:
            if spec.layout == "pack-quantized":
                register_tagged(layer, "weight_packed", torch.empty(N, K // pf, dtype=torch.int32), output_dim=0,
                                input_dim=1, packed=(1, pf))
                _register_ignored(layer, "weight_shape", self._shape_checker(layer))
            else:
                register_tagged(layer, "weight", torch.empty(N, K, dtype=torch.int8), output_dim=0, input_dim=1)
            self._register_scales(layer, "weight_scale", N, G, n_dim=0)
            if not spec.symmetric:
                packed = spec.layout == "pack-quantized"
                self._register_zeros(layer, "weight_zero_point", N // pf if packed else N, G, n_dim=0, packed=packed)
        g_idx_name = "g_idx" if spec.layout == "gptq" else "weight_g_idx"
        if spec.layout != "awq":
            if spec.act_order:
                self._register_g_idx(layer, g_idx_name, len(output_partition_sizes), K)
            else:
                _register_ignored(layer, g_idx_name, self._trivial_g_idx_checker(layer))

    def _check_shapes(self, layer: nn.Module, K: int, sizes: list[int]) -> None:
        """What the layout and the kernel need of this rank's shapes, as ConfigErrors naming the layer."""
        spec = self.spec
        tp = getattr(layer, "tp_size", 1)
        row_split = getattr(layer, "tp_split", None) == "input" and tp > 1
        where = f"layer {self.layer_name!r} ({spec.source}, {spec.name})"
        per_rank = f"{K} input features" + (f" per rank (tensor_parallel_size={tp})" if row_split else "")
        if spec.act_order and row_split:
            raise ConfigError(f"invalid tensor_parallel_size={tp} for {where}: its weights are act-order quantized "
                              f"({spec.act_order_field}, a g_idx that reorders the input features), and a "
                              "row-parallel rank's slice of the features would hold parts of many groups, which the "
                              "weight-only kernel cannot run; use tensor_parallel_size=1, or a checkpoint quantized "
                              "without act-order")
        if spec.grouped:
            if spec.group_size % GROUP_MULTIPLE or K % spec.group_size:
                raise ConfigError(f"invalid {spec.group_field}={spec.group_size} for {where}: its {per_rank} must be "
                                  f"whole groups, and the group size a multiple of {GROUP_MULTIPLE} (the kernel's "
                                  "K step)" + ("; use a smaller tensor_parallel_size" if row_split else ""))
        elif K % GROUP_MULTIPLE:
            raise ConfigError(f"invalid shape for {where}: per-channel weights need the {per_rank} to be a "
                              f"multiple of {GROUP_MULTIPLE}")
        n_packed = spec.layout == "awq" or (not spec.symmetric and spec.layout in ("gptq", "pack-quantized"))
        if n_packed and any(size % spec.pack_factor for size in sizes):
            raise ConfigError(f"invalid shape for {where}: the checkpoint packs {spec.pack_factor} output features "
                              f"per int32, and this rank's output sizes {sizes} (per merged part) are not whole "
                              "words" + ("; use a smaller tensor_parallel_size" if tp > 1 else ""))

    def _register_scales(self, layer: nn.Module, name: str, rows: int, cols: int, n_dim: int) -> None:
        # float32 holds any checkpoint's scales exactly; process_after_loading narrows them where that is exact.
        register_tagged(layer, name, torch.empty(rows, cols, dtype=torch.float32), output_dim=n_dim,
                        input_dim=1 - n_dim if self.spec.grouped else None, group_size=self.spec.group_size)

    def _register_zeros(self, layer: nn.Module, name: str, rows: int, cols: int, n_dim: int, packed: bool) -> None:
        register_tagged(layer, name, torch.empty(rows, cols, dtype=torch.int32), output_dim=n_dim,
                        input_dim=1 - n_dim if self.spec.grouped else None, group_size=self.spec.group_size,
                        packed=(n_dim, self.spec.pack_factor) if packed else None)

    def _register_g_idx(self, layer: nn.Module, name: str, num_parts: int, K: int) -> None:
        """One act-order g_idx per merged part (-1: not in the checkpoint); they must agree after loading."""
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if loaded.numel() != K:
                raise ValueError(f"{self.layer_name}.{name}: {loaded.numel()} entries, the layer has {K} input "
                                 "features")
            rows = range(num_parts) if shard_id is None else [layer.shard_index(shard_id)]
            for row in rows:
                param.data[row].copy_(loaded.reshape(-1))

        register_tagged(layer, name, torch.full((num_parts, K), -1, dtype=torch.int32), loader=load, optional=True)

    def _trivial_g_idx_checker(self, layer: nn.Module) -> Callable:
        spec = self.spec

        def check(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            K = layer.input_size  # the whole checkpoint tensor comes in, whatever this rank's slice
            group = spec.group_size if spec.grouped else K
            g_idx = loaded.reshape(-1).to(torch.int64)
            expected = torch.arange(g_idx.numel(), device=g_idx.device) // group
            if not (bool((g_idx < 0).all()) or torch.equal(g_idx, expected)):
                raise ConfigError(f"invalid {spec.act_order_field}: {spec.source} says no act-order, and layer "
                                  f"{self.layer_name!r} has a g_idx that reorders its input features; the "
                                  "checkpoint's config does not match its tensors")

        return check

    def _shape_checker(self, layer: nn.Module) -> Callable:
        def check(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            shape = [int(v) for v in loaded.reshape(-1).tolist()]
            if len(shape) != 2 or shape[1] != layer.input_size:
                raise ValueError(f"{self.layer_name}.weight_shape={shape}: the layer has {layer.input_size} input "
                                 "features")

        return check

    def process_after_loading(self, layer: nn.Module) -> None:
        spec = self.spec
        scales_name = "scales" if spec.layout in ("gptq", "awq") else "weight_scale"
        scales = self.finite(layer, scales_name)
        scale_dtype = compact_dtype(scales, self.model_dtype)
        g_idx = self._g_idx(layer)
        if spec.layout == "gptq":
            zeros = None if spec.symmetric else layer.qzeros.detach()
            weight = ops.repack_gptq(layer.qweight.detach(), scales, zeros, g_idx, bits=spec.bits,
                                     sym=spec.symmetric, zeros_minus_one=spec.zeros_minus_one,
                                     scale_dtype=scale_dtype)
        elif spec.layout == "awq":
            weight = ops.repack_awq(layer.qweight.detach(), layer.qzeros.detach(), scales, scale_dtype=scale_dtype)
        elif spec.layout == "pack-quantized":
            zeros = None if spec.symmetric else layer.weight_zero_point.detach()
            weight = ops.repack_compressed_tensors(layer.weight_packed.detach(), scales, zeros, g_idx,
                                                   num_bits=spec.bits, scale_dtype=scale_dtype)
        else:
            weight = _from_int_quantized(layer, spec, scales, g_idx, scale_dtype)
        self.install(layer, weight)

    def finite(self, layer: nn.Module, name: str) -> torch.Tensor:
        """The loaded parameter `name`, a ValueError naming it unless every value is finite."""
        tensor = layer.get_parameter(name).detach()
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{self.layer_name}.{name} must be finite")
        return tensor

    def install(self, layer: nn.Module, weight: ops.WNA16Weight) -> None:
        """The checkpoint's tensors replaced by the kernel's (`wna16_qweight`, ...)."""
        for name in [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]:
            delattr(layer, name)
        self.weight_type = weight.weight_type
        for name, tensor in zip(("qweight", "scales", "zeros", "perm"), weight[:4], strict=True):
            layer.register_parameter(f"wna16_{name}",
                                     None if tensor is None else nn.Parameter(tensor, requires_grad=False))

    def _g_idx(self, layer: nn.Module) -> torch.Tensor | None:
        name = "g_idx" if self.spec.layout == "gptq" else "weight_g_idx"
        if not self.spec.act_order:
            return None
        rows = layer.get_parameter(name).detach()
        if not bool((rows == rows[0]).all()):
            raise ValueError(f"layer {self.layer_name!r}: its merged parts were saved with different act-order "
                             f"permutations ({name}); kestrel runs them as one GEMM with one permutation")
        return rows[0]

    # -------------------------------------------------------------------------------------- inference

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = ops.wna16_gemm(x2, layer.wna16_qweight, layer.wna16_scales, layer.wna16_zeros, layer.wna16_perm,
                             self.weight_type, x.dtype, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _from_int_quantized(layer: nn.Module, spec: WNA16Spec, scales: torch.Tensor, g_idx: torch.Tensor | None,
                        scale_dtype: torch.dtype) -> ops.WNA16Weight:
    """compressed-tensors int-quantized: signed values (int8 holding [-8, 7] for 4 bits), signed zero points."""
    values = layer.weight.detach().to(torch.int32)
    zeros = None if spec.symmetric else layer.weight_zero_point.detach().to(torch.int32)
    if spec.bits == 8:
        return ops.pack_wna16(values, scales, zeros, g_idx, weight_type="int8", scale_dtype=scale_dtype)
    if zeros is None:
        return ops.pack_wna16(values, scales, None, g_idx, weight_type="int4", scale_dtype=scale_dtype)
    return ops.pack_wna16(values + 8, scales, zeros + 8, g_idx, weight_type="uint4", scale_dtype=scale_dtype)


def compact_dtype(scales: torch.Tensor, model_dtype: torch.dtype) -> torch.dtype:
    """The narrowest of the model dtype, float16 and bfloat16 that holds every scale exactly; else float32."""
    for dtype in dict.fromkeys((model_dtype, *_SCALE_DTYPES)):
        if dtype in _SCALE_DTYPES and torch.equal(scales.to(dtype).to(scales.dtype), scales):
            return dtype
    return torch.float32


def register_tagged(layer: nn.Module, name: str, data: torch.Tensor, *, output_dim: int | None = None,
                    input_dim: int | None = None, group_size: int | None = None,
                    packed: tuple[int, int] | None = None, loader: Callable | None = None,
                    optional: bool = False) -> None:
    """A parameter with the loader's tags (`kestrel.model.layers.weights`); untagged dims are loaded whole."""
    param = nn.Parameter(data, requires_grad=False)
    if output_dim is not None:
        param.output_dim = output_dim
    if input_dim is not None:
        param.input_dim = input_dim
        if group_size is not None and group_size > 0:
            param.group_size = group_size
    if packed is not None:
        param.packed_dim, param.packed_factor = packed
    if loader is not None:
        param.weight_loader = loader
    if optional:
        param.checkpoint_optional = True
    layer.register_parameter(name, param)


def _register_ignored(layer: nn.Module, name: str, check: Callable | None = None) -> None:
    """An empty placeholder for a tensor the checkpoint may carry and the kernel does not need: its loader checks
    it (`check`) and keeps nothing."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if check is not None:
            check(param, loaded, shard_id)

    register_tagged(layer, name, torch.empty(0, dtype=torch.int32), loader=load, optional=True)


def one_spec(layer_name: str, parts: Sequence[str], spec_for: Callable[[str], WNA16Spec | None],
             scheme: str) -> WNA16Spec | None:
    """The one spec of a layer merged from the checkpoint modules `parts` (a ConfigError listing each part's when
    they differ), or None when the layer stays unquantized."""
    specs = {part: spec_for(part) for part in list(parts) or [layer_name]}
    distinct = set(specs.values())
    if len(distinct) > 1:
        listed = ", ".join(f"{part}: {describe(spec)}" for part, spec in specs.items())
        raise ConfigError(f"invalid quantization_config (quant_method={scheme!r}): the modules merged into "
                          f"{layer_name} were saved with different schemes ({listed}); kestrel runs them as one GEMM")
    return distinct.pop()


def describe(spec: WNA16Spec | None) -> str:
    if spec is None:
        return "unquantized"
    group = f"group {spec.group_size}" if spec.grouped else "per channel"
    return (f"{spec.bits}-bit {'symmetric' if spec.symmetric else 'asymmetric'}, {group}"
            + (", act-order" if spec.act_order else ""))
