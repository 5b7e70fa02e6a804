"""`kestrel bench moe`: the fused mixture-of-experts kernel against the roofline and torch anchors (BENCHMARKS.md).

For each model shape (E experts, top-k, hidden H, intermediate I), routing (uniform or Zipf-skewed top-k, seeded)
and batch of T tokens this times `kestrel.ops.fused_moe` (`--dtype fp8`: the kernel's FP8 weight path, when the
kernel has one) and reports:
- the bytes the call must move: the weights of the distinct experts the batch's routing chose, counted from the
  routing, plus the activations (x read, the output written, the routing read);
- achieved GB/s against the device-to-device copy bandwidth measured in the same run;
- FLOPs `2 T k (2I H + I H)`, TFLOP/s, and "x roofline" = time / max(bytes / bandwidth, FLOPs / peak);
- anchors timed in the same run on the same inputs: `torch_experts`, a per-expert loop in plain torch (one
  pair of `F.linear` over each chosen expert's tokens, as Hugging Face's Mixtral / Qwen-MoE blocks do: the same
  weights read, the same FLOPs), and `dense_mm`, two dense cuBLAS GEMMs `[T*k, H] x [H, 2I]` and
  `[T*k, I] x [I, H]` over one expert's weights: the same FLOPs with one expert's bytes, a lower bound
  (`--dtype fp8` adds `dense_mm_fp8`, the same two GEMMs in `torch._scaled_mm` rowwise FP8, quantization left out);
- the routing's per-expert load (tokens per expert), so hot experts show.

Method: every variant is checked against a reference before it is timed (the kernel against
`kestrel.kernels.fused_moe.fused_moe_ref`, relative Frobenius error). Timing captures one CUDA graph holding one
call per rotated input set (its own x, routing and, where weights would otherwise fit in L2, its own copy of the
layer's weights, like successive layers of a model), replays it `--runs` times (>= 50) with CUDA events around
each replay after warm-up, and reports the median per call; each variant is timed in two rounds and the faster
one is kept (the spread between rounds is recorded). `--smoke` runs a tiny shape on the CPU through the
reference path of `kestrel.ops` (timed with perf_counter) to check this script.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kestrel import ops
from kestrel.bench import gemm as gemm_bench
from kestrel.bench import register_suite, standalone_main
from kestrel.bench.timing import time_calls
from kestrel.config import ConfigError
from kestrel.kernels import fused_moe as fm

# name: (E, k, H, I)
SHAPES: dict[str, tuple[int, int, int, int]] = {"qwen3-30b-a3b": (128, 8, 2048, 768),
                                                "mixtral-8x7b": (8, 2, 4096, 14336)}
SMOKE_SHAPES: dict[str, tuple[int, int, int, int]] = {"tiny": (8, 2, 64, 32)}
BATCHES = (1, 8, 32, 128, 512, 2048)
SMOKE_BATCHES = (1, 4, 16)
ROUTINGS = ("uniform", "zipf")
ANCHORS = ("torch_experts", "dense_mm", "dense_mm_fp8")
ANCHOR_LABELS = {"torch_experts": "torch", "dense_mm": "dense", "dense_mm_fp8": "dense8"}
ACTIVATION = "silu"
ROTATE_BYTES = 3 * 60 * 2**20  # three times the H200's L2
MAX_SETS = 24
MAX_LAYERS = 4  # weight copies per shape, for rotation when one call's experts would fit in L2
WEIGHT_BUDGET = 32 * 2**30  # bytes of weight copies per shape at most
MIN_GPU_RUNS = 50
FP8_MAX = 448.0
FP8_KWARGS = ("w13_scale", "w2_scale", "block_shape")
# Relative Frobenius error bounds. The kernel and its reference differ in accumulation order only (the GPU tests
# see <= 2^-10 at these shapes); the torch anchors round the gate/up outputs, the activation, the product, the
# weighted down output and every partial sum in bf16 (~6e-3 at the preset shapes on the CPU). FP8: against the
# reference's own FP8 path when it has one, else against the dequantized weights with bf16 activations.
ERR_LIMIT = {"bf16": 2.0**-8, "fp8": 3e-2, "fp8_dequant": 1e-1, "anchor": 2e-2}
DENSE_CHECK_ROWS = 64


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class Shape:
    name: str
    E: int
    k: int
    H: int
    I: int  # noqa: E741 - the intermediate size, as the kernel's docstring names it

    def expert_params(self) -> int:
        return 3 * self.I * self.H  # gate and up [2I, H], down [H, I]

    def flops(self, T: int) -> int:
        return 2 * T * self.k * (2 * self.I * self.H + self.I * self.H)


def parse_shapes(specs: list[str] | None, smoke: bool) -> list[Shape]:
    """Preset names (comma-separated) or `E,k,H,I`; several specs by repeating `--shape` or with `;`."""
    presets = SMOKE_SHAPES if smoke else SHAPES
    if not specs:
        return [Shape(n, *dims) for n, dims in presets.items()]
    known = {**SHAPES, **SMOKE_SHAPES}
    shapes: list[Shape] = []
    for spec in (s.strip() for group in specs for s in group.split(";") if s.strip()):
        parts = [p.strip() for p in spec.split(",")]
        if all(p.lstrip("-").isdigit() for p in parts):
            if len(parts) != 4:
                raise ConfigError(f"invalid --shape={spec!r}: expected E,k,H,I (four integers) or one of "
                                  f"{sorted(SHAPES)}")
            E, k, H, inter = (int(p) for p in parts)
            if min(E, k, H, inter) <= 0 or k > E:
                raise ConfigError(f"invalid --shape={spec!r}: E, k, H, I must be positive with k <= E")
            shapes.append(Shape(f"E{E}-k{k}-H{H}-I{inter}", E, k, H, inter))
            continue
        for name in parts:
            if name not in known:
                raise ConfigError(f"invalid --shape={name!r}: expected one of {sorted(SHAPES)} or E,k,H,I")
            shapes.append(Shape(name, *known[name]))
    return shapes


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"invalid {flag}={text!r}: expected a comma-separated list of integers") from None
    if not values or min(values) <= 0:
        raise ConfigError(f"invalid {flag}={text!r}: expected positive integers")
    return values


# ------------------------------------------------------------------------------------------------ routing


def zipf_probs(E: int, s: float, hot_order: torch.Tensor) -> torch.Tensor:
    """Expert `hot_order[r]` is chosen with weight `1 / (r + 1)^s`."""
    p = torch.empty(E, dtype=torch.float64)
    p[hot_order] = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    return p / p.sum()


def make_routing(T: int, E: int, k: int, kind: str, gen: torch.Generator, zipf_s: float = 1.0,
                 hot_order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [T, k], topk_ids int32 [T, k]) on the CPU: k distinct experts per token, weights the
    softmax of random router logits over the k chosen (the renormalised top-k of Qwen3 and Mixtral).
    uniform: the top-k of iid logits (every k-subset equally likely); zipf: k experts drawn without replacement
    with Zipf(s) popularity over `hot_order` (hot experts)."""
    logits = torch.randn(T, E, generator=gen)
    if kind == "uniform":
        top, ids = logits.topk(k, dim=-1)
    elif kind == "zipf":
        order = hot_order if hot_order is not None else torch.arange(E)
        probs = zipf_probs(E, zipf_s, order).expand(T, E).contiguous()
        ids = torch.multinomial(probs, k, replacement=False, generator=gen)
        top = logits.gather(1, ids)
    else:
        raise ConfigError(f"invalid --routing={kind!r}: expected one of {list(ROUTINGS)}")
    return top.softmax(dim=-1).float(), ids.to(torch.int32)


def expert_load(topk_ids: torch.Tensor, E: int) -> list[int]:
    """Tokens routed to each expert."""
    return torch.bincount(topk_ids.reshape(-1).long().cpu(), minlength=E).tolist()


def load_per_layer(batches: list[Batch], E: int) -> dict[str, list[int]]:
    """{weight layer: tokens per expert} over every input set the point routes to that layer (JSON keys)."""
    per_layer: dict[int, list[int]] = {}
    for b in batches:
        per_layer[b.layer] = [a + c for a, c in zip(per_layer.get(b.layer, [0] * E), b.load)]
    return {str(layer): per_layer[layer] for layer in sorted(per_layer)}


def moe_bytes(topk_ids: torch.Tensor, shape: Shape, weight_elt: float = 2, act_elt: int = 2,
              scale_bytes_per_expert: int = 0) -> dict[str, int]:
    """The bytes one call must move at least: the weights (and weight scales) of each distinct expert the routing
    chose, once, plus x read, the output written and the routing (fp32 weights, ids) read."""
    T, k = topk_ids.shape
    distinct = int(torch.unique(topk_ids.reshape(-1)).numel())
    weights = distinct * (int(shape.expert_params() * weight_elt) + scale_bytes_per_expert)
    acts = 2 * T * shape.H * act_elt + T * k * (4 + topk_ids.element_size())
    return {"distinct_experts": distinct, "weight_bytes": weights, "act_bytes": acts, "bytes": weights + acts}


# ------------------------------------------------------------------------------------------------ fp8


def fp8_entry(device: torch.device) -> Callable[..., Any]:
    """The FP8 call: `kestrel.ops.fused_moe` when it passes the FP8 keywords on, else the kernel module's function
    for the device (the Triton kernel on a GPU, its reference on the CPU)."""
    if not fp8_missing(ops.fused_moe):
        return ops.fused_moe
    return fm.fused_moe if device.type == "cuda" else fm.fused_moe_ref


def fp8_missing(fn: Callable[..., Any]) -> list[str]:
    """The FP8 keywords (`w13_scale`, `w2_scale`, `block_shape`) that `fn` does not take."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return list(FP8_KWARGS)
    return [name for name in FP8_KWARGS if name not in params]


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights `[E, N, K]` and fp32 scales: per output channel `[E, N]` (block None) or per `[bn, bk]` block
    `[E, ceil(N / bn), ceil(K / bk)]`; one expert at a time (bounded temporary memory)."""
    E, N, K = w.shape
    q = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    if block is None:
        scale = torch.empty(E, N, dtype=torch.float32, device=w.device)
    else:
        scale = torch.empty(E, math.ceil(N / block[0]), math.ceil(K / block[1]), dtype=torch.float32, device=w.device)
    for e in range(E):
        we = w[e].float()
        if block is None:
            s = we.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
            full = s[:, None]
        else:
            bn, bk = block
            nb, kb = scale.shape[1:]
            padded = F.pad(we, (0, kb * bk - K, 0, nb * bn - N))
            s = padded.reshape(nb, bn, kb, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
            full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:N, :K]
        scale[e] = s
        q[e] = (we / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """One expert's `[N, K]` weights in fp32."""
    N, K = q.shape
    if block is None:
        return q.float() * scale[:, None]
    return q.float() * scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:N, :K]


def fp8_scale_bytes(shape: Shape, block: tuple[int, int] | None) -> int:
    """fp32 scale bytes of one expert (w13 and w2)."""
    if block is None:
        return 4 * (2 * shape.I + shape.H)
    bn, bk = block
    blocks = (math.ceil(2 * shape.I / bn) * math.ceil(shape.H / bk) + math.ceil(shape.H / bn) * math.ceil(shape.I / bk))
    return 4 * blocks


def fp8_dequant_ref(x: torch.Tensor, layer: Layer, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    block: tuple[int, int] | None) -> torch.Tensor:
    """`fused_moe_ref`'s numerics on the dequantized FP8 weights (activations not quantized): the reference when
    the kernel's own reference takes no FP8 scales."""
    T, k = topk_ids.shape
    inter = layer.w13.shape[1] // 2
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=layer.w13.shape[0]).tolist()
    tokens, weights = order // k, topk_weights.reshape(-1).float()[order]
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = tokens[start:start + n]
            gate_up = x.index_select(0, rows).float() @ dequantize_fp8(layer.q13[e], layer.s13[e], block).T
            act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).float()
            down = act @ dequantize_fp8(layer.q2[e], layer.s2[e], block).T
            out.index_add_(0, rows, down * weights[start:start + n, None])
        start += n
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------------ data


@dataclass
class Layer:
    """One layer's expert weights (bf16; with their FP8 quantization for `--dtype fp8`) and its hot experts."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    hot_order: torch.Tensor  # expert ids from hottest to coldest (Zipf routing)
    q13: torch.Tensor | None = None
    s13: torch.Tensor | None = None
    q2: torch.Tensor | None = None
    s2: torch.Tensor | None = None


@dataclass
class Batch:
    layer: int
    x: torch.Tensor  # [T, H] bf16
    topk_weights: torch.Tensor  # [T, k] fp32
    topk_ids: torch.Tensor  # [T, k] int32
    counted: dict[str, int]
    load: list[int]
    plan: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class Ctx:
    device: torch.device
    dtype: str  # bf16 | fp8
    fp8_block: tuple[int, int] | None
    runs: int
    routings: tuple[str, ...]
    batches: tuple[int, ...]
    anchors: tuple[str, ...]
    zipf_s: float
    seed: int
    ceilings: dict

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8"

    def weight_elt(self) -> int:
        return 1 if self.fp8 else 2

    def peak(self) -> float:
        return self.ceilings["eight_bit"] if self.fp8 else self.ceilings["bf16"]


def seed_of(*parts: object) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def make_layers(ctx: Ctx, shape: Shape, count: int) -> list[Layer]:
    layers = []
    E, H, inter = shape.E, shape.H, shape.I
    for i in range(count):
        gen = torch.Generator(device=ctx.device).manual_seed(seed_of(ctx.seed, shape.name, "layer", i))
        w13 = torch.empty(E, 2 * inter, H, dtype=torch.bfloat16, device=ctx.device)
        w2 = torch.empty(E, H, inter, dtype=torch.bfloat16, device=ctx.device)
        for e in range(E):  # one expert at a time: bounded fp32 temporaries
            w13[e] = torch.randn(2 * inter, H, generator=gen, device=ctx.device) / math.sqrt(H)
            w2[e] = torch.randn(H, inter, generator=gen, device=ctx.device) / math.sqrt(inter)
        hot = torch.randperm(E, generator=torch.Generator().manual_seed(seed_of(ctx.seed, shape.name, "hot", i)))
        layer = Layer(w13, w2, hot)
        if ctx.fp8:
            layer.q13, layer.s13 = quantize_fp8(w13, ctx.fp8_block)
            layer.q2, layer.s2 = quantize_fp8(w2, ctx.fp8_block)
        layers.append(layer)
    return layers


def layer_count(ctx: Ctx, shape: Shape) -> int:
    """Weight copies so that the smallest batch's calls, rotated, overflow L2 (within WEIGHT_BUDGET)."""
    if ctx.device.type != "cuda":
        return 2
    expert = shape.expert_params() * ctx.weight_elt()
    smallest = min(shape.E, min(ctx.batches) * shape.k) * expert
    layer_bytes = shape.E * shape.expert_params() * (2 + (ctx.weight_elt() if ctx.fp8 else 0))
    wanted = min(MAX_LAYERS, math.ceil(ROTATE_BYTES / smallest))
    return max(1, min(wanted, WEIGHT_BUDGET // layer_bytes))


def make_batch(ctx: Ctx, shape: Shape, layers: list[Layer], routing: str, T: int, index: int) -> Batch:
    layer = index % len(layers)
    gen = torch.Generator().manual_seed(seed_of(ctx.seed, shape.name, routing, T, index))
    weights, ids = make_routing(T, shape.E, shape.k, routing, gen, ctx.zipf_s, layers[layer].hot_order)
    scale_bytes = fp8_scale_bytes(shape, ctx.fp8_block) if ctx.fp8 else 0
    counted = moe_bytes(ids, shape, ctx.weight_elt(), 2, scale_bytes)
    xgen = torch.Generator(device=ctx.device).manual_seed(seed_of(ctx.seed, shape.name, routing, T, index, "x"))
    x = torch.randn(T, shape.H, generator=xgen, device=ctx.device).to(torch.bfloat16)
    batch = Batch(layer, x, weights.to(ctx.device), ids.to(ctx.device), counted, expert_load(ids, shape.E))
    if "torch_experts" in ctx.anchors:
        batch.plan = expert_plan(weights, ids, shape.E, ctx.device)
    return batch


def make_batches(ctx: Ctx, shape: Shape, layers: list[Layer], routing: str, T: int) -> list[Batch]:
    """Enough input sets (x, routing, layer) that one round of calls moves more than L2 holds."""
    first = make_batch(ctx, shape, layers, routing, T, 0)
    count = 2 if ctx.device.type != "cuda" else max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / first.counted["bytes"])))
    return [first] + [make_batch(ctx, shape, layers, routing, T, i) for i in range(1, count)]


# ------------------------------------------------------------------------------------------------ variants


def fused_call(ctx: Ctx, layer: Layer, b: Batch) -> torch.Tensor:
    if not ctx.fp8:
        return ops.fused_moe(b.x, layer.w13, layer.w2, b.topk_weights, b.topk_ids, ACTIVATION)
    return fp8_entry(ctx.device)(b.x, layer.q13, layer.q2, b.topk_weights, b.topk_ids, ACTIVATION,
                                 w13_scale=layer.s13, w2_scale=layer.s2, block_shape=ctx.fp8_block)


def fused_reference(ctx: Ctx, layer: Layer, b: Batch) -> tuple[torch.Tensor, str]:
    """The kernel's expectation and the name of the reference (its error bound's key)."""
    if not ctx.fp8:
        return fm.fused_moe_ref(b.x, layer.w13, layer.w2, b.topk_weights, b.topk_ids, ACTIVATION), "bf16"
    if not fp8_missing(fm.fused_moe_ref):
        return fm.fused_moe_ref(b.x, layer.q13, layer.q2, b.topk_weights, b.topk_ids, ACTIVATION, w13_scale=layer.s13,
                                w2_scale=layer.s2, block_shape=ctx.fp8_block), "fp8"
    return fp8_dequant_ref(b.x, layer, b.topk_weights, b.topk_ids, ctx.fp8_block), "fp8_dequant"


def expert_plan(topk_weights: torch.Tensor, topk_ids: torch.Tensor, E: int,
                device: torch.device) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, its tokens, their routing weights [n, 1] in bf16) for each expert chosen: the host-side split of a
    plain torch MoE, done before timing."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    tokens, weights = order // k, topk_weights.reshape(-1)[order]
    plan, start = [], 0
    for e, n in enumerate(counts):
        if n:
            plan.append((e, tokens[start:start + n].to(device),
                         weights[start:start + n, None].to(device=device, dtype=torch.bfloat16)))
        start += n
    return plan


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  plan: list[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Hugging Face's sparse-MoE loop: per chosen expert, gather its tokens, two GEMMs, weight, scatter-add."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for e, rows, w in plan:
        h = F.linear(x.index_select(0, rows), w13[e])
        out.index_add_(0, rows, F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e]) * w)
    return out


@dataclass
class Dense:
    xk: torch.Tensor  # [T*k, H]: each token once per chosen expert
    inter: torch.Tensor  # [T*k, I]
    w13: torch.Tensor  # [2I, H], one expert's
    w2: torch.Tensor  # [H, I]


def dense_call(d: Dense) -> tuple[torch.Tensor, torch.Tensor]:
    return F.linear(d.xk, d.w13), F.linear(d.inter, d.w2)


@dataclass
class DenseFp8:
    """The dense anchor's operands in e4m3 for `torch._scaled_mm` rowwise: activations per token, weights per
    output channel (quantized before timing: a lower bound that leaves the activation quantization out)."""

    xq: torch.Tensor
    xs: torch.Tensor  # [T*k, 1]
    w13q: torch.Tensor
    w13s: torch.Tensor  # [1, 2I]
    iq: torch.Tensor
    i_s: torch.Tensor  # [T*k, 1]
    w2q: torch.Tensor
    w2s: torch.Tensor  # [1, H]


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (t.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def dense_fp8(d: Dense) -> DenseFp8:
    (xq, xs), (iq, i_s) = rowwise_fp8(d.xk), rowwise_fp8(d.inter)
    (w13q, w13s), (w2q, w2s) = rowwise_fp8(d.w13), rowwise_fp8(d.w2)
    return DenseFp8(xq, xs, w13q, w13s.T.contiguous(), iq, i_s, w2q, w2s.T.contiguous())


def dense_fp8_call(d: DenseFp8) -> tuple[torch.Tensor, torch.Tensor]:
    mm = torch._scaled_mm
    return (mm(d.xq, d.w13q.t(), d.xs, d.w13s, out_dtype=torch.bfloat16),
            mm(d.iq, d.w2q.t(), d.i_s, d.w2s, out_dtype=torch.bfloat16))


def make_dense(ctx: Ctx, shape: Shape, layers: list[Layer], batches: list[Batch]) -> list[Dense]:
    """Input sets of the dense anchor: set j uses expert j // layers of layer j % layers (distinct weights, so the
    rotation overflows L2 as the kernel's does)."""
    T, k, H, inter = batches[0].x.shape[0], shape.k, shape.H, shape.I
    per_call = shape.expert_params() * 2 + T * k * (2 * H + 3 * inter) * 2
    count = 2 if ctx.device.type != "cuda" else max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / per_call)))
    sets = []
    for j in range(count):
        layer = layers[j % len(layers)]
        e = (j // len(layers)) % shape.E
        xk = batches[j % len(batches)].x.repeat_interleave(k, dim=0)
        h = F.linear(xk, layer.w13[e])
        sets.append(Dense(xk, F.silu(h[:, :inter]) * h[:, inter:], layer.w13[e], layer.w2[e]))
        del h
    return sets


# ------------------------------------------------------------------------------------------------ check and time


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def checked_call(fn: Callable[[], Any], shape: tuple[int, ...], device: torch.device) -> Any:
    """Run once right after freeing a NaN-filled block of the output's size: the caching allocator hands that
    block back, so an element the kernel never writes shows up as NaN (as the gemm suite does)."""
    poison = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
    del poison
    return fn()


def measure(check: Callable[[], tuple[float, float]], calls: list[Callable[[], Any]], ctx: Ctx) -> dict:
    """Check first (error, bound), then time; a failing variant becomes a status, not a crash."""
    try:
        err, limit = check()
        if not err <= limit:
            return {"status": "wrong", "err": err, "err_limit": limit}
        us, graphed = time_calls(calls, ctx.runs, ctx.device)
    except Exception as exc:  # one failing variant must not sink the whole run
        return {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"status": "ok", "err": err, "err_limit": limit, "us": us, "graph": graphed}


def run_point(ctx: Ctx, shape: Shape, layers: list[Layer], routing: str, T: int) -> dict:
    batches = make_batches(ctx, shape, layers, routing, T)
    b0, l0 = batches[0], layers[batches[0].layer]
    byts = sum(b.counted["bytes"] for b in batches) / len(batches)
    flops = shape.flops(T)
    mem_us, compute_us = byts / ctx.ceilings["bw"] * 1e6, flops / ctx.peak() * 1e6
    loads = b0.load
    row: dict[str, Any] = {
        "shape": shape.name, "E": shape.E, "k": shape.k, "H": shape.H, "I": shape.I, "T": T, "routing": routing,
        "dtype": ctx.dtype, "sets": len(batches), "weight_layers": len(layers),
        "distinct_experts": sum(b.counted["distinct_experts"] for b in batches) / len(batches),
        "distinct_experts_per_set": [b.counted["distinct_experts"] for b in batches],
        "expert_load": loads, "expert_load_per_layer": load_per_layer(batches, shape.E),
        "load_max": max(loads), "load_mean": T * shape.k / shape.E,
        "load_imbalance": max(loads) / (T * shape.k / shape.E),
        "bytes": byts, "weight_bytes": sum(b.counted["weight_bytes"] for b in batches) / len(batches),
        "act_bytes": b0.counted["act_bytes"], "flops": flops, "intensity": flops / byts,
        "roofline_us": max(mem_us, compute_us), "roofline_bound": "memory" if mem_us >= compute_us else "compute",
    }
    ref_cache: dict[str, tuple[torch.Tensor, str]] = {}

    def reference(kind: str) -> tuple[torch.Tensor, str]:
        if kind not in ref_cache:
            if kind == "bf16":
                ref_cache[kind] = (fm.fused_moe_ref(b0.x, l0.w13, l0.w2, b0.topk_weights, b0.topk_ids, ACTIVATION),
                                   "bf16")
            else:
                ref_cache[kind] = fused_reference(ctx, l0, b0)
        return ref_cache[kind]

    def check_fused() -> tuple[float, float]:
        out = checked_call(lambda: fused_call(ctx, l0, b0), (T, shape.H), ctx.device)
        ref, kind = reference("fused" if ctx.fp8 else "bf16")
        return rel_err(out, ref), ERR_LIMIT[kind]

    variants: dict[str, tuple[Callable[[], tuple[float, float]], list[Callable[[], Any]]]] = {
        "fused_moe": (check_fused, [(lambda b=b: fused_call(ctx, layers[b.layer], b)) for b in batches])}
    if "torch_experts" in ctx.anchors:
        def check_torch() -> tuple[float, float]:
            out = torch_experts(b0.x, l0.w13, l0.w2, b0.plan)
            return rel_err(out, reference("bf16")[0]), ERR_LIMIT["anchor"]

        variants["torch_experts"] = (check_torch, [
            (lambda b=b: torch_experts(b.x, layers[b.layer].w13, layers[b.layer].w2, b.plan)) for b in batches])
    dense = make_dense(ctx, shape, layers, batches) if {"dense_mm", "dense_mm_fp8"} & set(ctx.anchors) else []
    if "dense_mm" in ctx.anchors:

        def check_dense() -> tuple[float, float]:
            d, r = dense[0], DENSE_CHECK_ROWS
            h, out = dense_call(d)
            return max(rel_err(h[:r], d.xk[:r].float() @ d.w13.float().T),
                       rel_err(out[:r], d.inter[:r].float() @ d.w2.float().T)), ERR_LIMIT["anchor"]

        variants["dense_mm"] = (check_dense, [(lambda d=d: dense_call(d)) for d in dense])
    if "dense_mm_fp8" in ctx.anchors:
        dense8 = [dense_fp8(d) for d in dense]

        def check_dense8() -> tuple[float, float]:
            d, r = dense8[0], DENSE_CHECK_ROWS
            h, out = dense_fp8_call(d)
            w13, w2 = d.w13q.float() * d.w13s.T, d.w2q.float() * d.w2s.T
            return max(rel_err(h[:r], (d.xq[:r].float() * d.xs[:r]) @ w13.T),
                       rel_err(out[:r], (d.iq[:r].float() * d.i_s[:r]) @ w2.T)), ERR_LIMIT["anchor"]

        variants["dense_mm_fp8"] = (check_dense8, [(lambda d=d: dense_fp8_call(d)) for d in dense8])
    if dense:
        row["dense_sets"] = len(dense)
    results = {name: measure(check, calls, ctx) for name, (check, calls) in variants.items()}
    # A second round in the same order: the spread between rounds is the noise floor (clocks, power).
    for name, (_, calls) in variants.items():
        r = results[name]
        if r["status"] == "ok":
            again, _ = time_calls(calls, ctx.runs, ctx.device)
            r["us_rounds"] = [r["us"], again]
            r["us"] = min(r["us"], again)
            r["TFLOPs"] = flops / r["us"] * 1e-6
    # The torch loop reads the same experts once at least, in bf16 (also under --dtype fp8).
    bf16_bytes = row["distinct_experts"] * shape.expert_params() * 2 + sum(
        2 * b.x.numel() * 2 + b.topk_ids.numel() * (4 + b.topk_ids.element_size()) for b in batches) / len(batches)
    bf16_roofline_us = max(bf16_bytes / ctx.ceilings["bw"], flops / ctx.ceilings["bf16"]) * 1e6
    for name, moved, roof in (("fused_moe", byts, row["roofline_us"]), ("torch_experts", bf16_bytes, bf16_roofline_us)):
        r = results.get(name)
        if r and r["status"] == "ok":
            r.update(bytes=moved, GBps=moved / r["us"] * 1e-3, frac_copy=moved / r["us"] * 1e6 / ctx.ceilings["bw"],
                     roofline_us=roof, x_roofline=r["us"] / roof)
    fused = results.pop("fused_moe")
    row.update(fused)
    row["anchors"] = results
    for name, r in results.items():
        if fused["status"] == "ok" and r["status"] == "ok":
            row[f"speedup_vs_{name}"] = r["us"] / fused["us"]
    return row


def bench(ctx: Ctx, shapes: list[Shape], on_point: Callable[[list[dict]], None] | None = None) -> list[dict]:
    rows: list[dict] = []
    for shape in shapes:
        t0 = time.time()
        layers = make_layers(ctx, shape, layer_count(ctx, shape))
        log(f"[{shape.name}] {len(layers)} weight layer(s) in {time.time() - t0:.1f}s")
        for routing in ctx.routings:
            for T in ctx.batches:
                t0 = time.time()
                row = run_point(ctx, shape, layers, routing, T)
                rows.append(row)
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()  # the point's inputs, references and graph pools are gone
                anchors = " ".join(f"{n}={a['us']:.1f}" for n, a in row["anchors"].items() if a["status"] == "ok")
                us = f"{row['us']:.1f} us x{row['x_roofline']:.2f} roofline" if row["status"] == "ok" else row["status"]
                log(f"[{shape.name} {routing} T={T} {time.time() - t0:.1f}s] fused {us}; {anchors}")
                for name, r in [("fused_moe", row), *row["anchors"].items()]:
                    if r["status"] != "ok":
                        log(f"  !! {name}: {r['status']} {r.get('err', '')} {r.get('reason', '')}")
                if on_point is not None:
                    on_point(rows)
        del layers
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ reports


def environment(device: torch.device, git_sha: str | None) -> dict:
    env = gemm_bench.environment(git_sha)
    if device.type != "cuda":
        env["gpu"] = "cpu (reference path of kestrel.ops)"
    return env


def _fit(v: float) -> str:
    return f"{v:9.2f}" if v < 1e4 else f"{v:9.1e}"


def summary_table(rows: list[dict], ceilings: dict) -> str:
    names = [n for n in ANCHORS if any(n in r["anchors"] for r in rows)]
    lines = [f"copy {ceilings['bw'] / 1e12:.2f} TB/s, bf16 {ceilings['bf16'] / 1e12:.0f}, 8-bit "
             f"{ceilings['eight_bit'] / 1e12:.0f} TFLOP/s{'' if ceilings.get('measured') else ' (not measured)'}",
             f"{'shape':<16}{'routing':<8}{'T':>6}{'exp':>6}{'MB':>8}{'fused us':>10}{'GB/s':>8}{'%copy':>7}"
             f"{'TFLOP/s':>9}{'x roof':>9}" + "".join(f"{ANCHOR_LABELS[n] + ' us':>10}" for n in names)
             + "".join(f"{'vs ' + ANCHOR_LABELS[n]:>10}" for n in names)]

    def us_of(r: dict | None) -> str:
        return f"{r['us']:10.1f}" if r and r.get("status") == "ok" else f"{(r or {}).get('status', '-'):>10}"

    def ratio(row: dict, name: str) -> str:
        v = row.get(f"speedup_vs_{name}")
        return f"{v:10.2f}" if v else f"{'-':>10}"

    for r in rows:
        ok = r["status"] == "ok"
        metrics = (f"{r['GBps']:8.0f}{100 * r['frac_copy']:7.1f}{r['TFLOPs']:9.1f}{_fit(r['x_roofline'])}" if ok
                   else f"{'-':>8}{'-':>7}{'-':>9}{'-':>9}")
        lines.append(f"{r['shape'][:15]:<16}{r['routing']:<8}{r['T']:>6}{r['distinct_experts']:6.1f}"
                     f"{r['bytes'] / 1e6:8.1f}{us_of(r)}{metrics}"
                     + "".join(us_of(r["anchors"].get(n)) for n in names) + "".join(ratio(r, n) for n in names))
    lines.append("(median us per call; exp = distinct experts per call; MB moved at least; x roof = time / "
                 "max(bytes / copy bw, FLOPs / peak); vs = anchor time / fused time)")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows, ceil = result["results"], result["ceilings"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(19, 5.8))
    peak = ceil["eight_bit"] if result["config"]["dtype"] == "fp8" else ceil["bf16"]
    xs = [0.1, 1e4]
    knee = peak / ceil["bw"]
    ax1.plot([xs[0], knee, xs[1]], [xs[0] * ceil["bw"] / 1e12, peak / 1e12, peak / 1e12], "-", color="gray",
             label=f"roofline {peak / 1e12:.0f} TFLOP/s, {ceil['bw'] / 1e12:.2f} TB/s")
    groups = list(dict.fromkeys((r["shape"], r["routing"]) for r in rows))
    for i, (shape, routing) in enumerate(groups):
        pts = [r for r in rows if (r["shape"], r["routing"]) == (shape, routing)]
        color = f"C{i % 10}"
        ok = [r for r in pts if r["status"] == "ok"]
        ax1.plot([r["intensity"] for r in ok], [r["TFLOPs"] for r in ok], "o-", color=color,
                 label=f"fused {shape} {routing}")
        te = [r for r in pts if r["anchors"].get("torch_experts", {}).get("status") == "ok"]
        ax1.plot([r["intensity"] for r in te], [r["anchors"]["torch_experts"]["TFLOPs"] for r in te], "x--",
                 color=color, alpha=0.6)
        ax2.plot([r["T"] for r in ok], [r["us"] for r in ok], "o-", color=color, label=f"fused {shape} {routing}")
        ax2.plot([r["T"] for r in te], [r["anchors"]["torch_experts"]["us"] for r in te], "x--", color=color,
                 alpha=0.6)
        dm = [r for r in pts if r["anchors"].get("dense_mm", {}).get("status") == "ok"]
        ax2.plot([r["T"] for r in dm], [r["anchors"]["dense_mm"]["us"] for r in dm], "^:", color=color, alpha=0.6)
        d8 = [r for r in pts if r["anchors"].get("dense_mm_fp8", {}).get("status") == "ok"]
        ax2.plot([r["T"] for r in d8], [r["anchors"]["dense_mm_fp8"]["us"] for r in d8], "v:", color=color, alpha=0.6)
        ax2.plot([r["T"] for r in pts], [r["roofline_us"] for r in pts], "-", color=color, lw=0.8, alpha=0.4)
        last = max(pts, key=lambda r: r["T"])
        load = sorted(last["expert_load"], reverse=True)
        ax3.plot([(j + 0.5) / len(load) for j in range(len(load))], [v / last["load_mean"] for v in load], ".-",
                 color=color, label=f"{shape} {routing} T={last['T']}")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("arithmetic intensity (FLOP / byte moved at least)")
    ax1.set_ylabel("achieved TFLOP/s")
    ax1.set_title(f"fused MoE ({result['config']['dtype']}) vs roofline; x: torch per-expert loop")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("tokens T")
    ax2.set_ylabel("median us per call")
    ax2.set_title("o fused, x torch per expert, ^ dense mm, v dense fp8 mm (lower bounds), line: roofline")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    ax3.set_xlabel("experts, hottest first (fraction of E)")
    ax3.set_ylabel("tokens per expert / mean")
    ax3.set_title("routing load at the largest batch (first input set)")
    ax3.grid(True, alpha=0.3)
    ax3.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------ CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", action="append", default=None,
                   help=f"a preset ({', '.join(SHAPES)}; comma-separated) or E,k,H,I; repeat for several "
                        "(default: both presets)")
    p.add_argument("--batch", default=None,
                   help=f"comma list of token counts T (default {','.join(map(str, BATCHES))})")
    p.add_argument("--routing", default="uniform",
                   help="comma list of: uniform (seeded random top-k), zipf (skewed: hot experts)")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of --routing zipf")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"],
                   help="fp8: e4m3 expert weights through the kernel's w13_scale / w2_scale / block_shape keywords "
                        "(refused when the kernel has none)")
    p.add_argument("--fp8-block", default=None,
                   help="FP8 weight scale blocks bn,bk, or 'channel' (default 128,128; 16,16 with --smoke)")
    p.add_argument("--anchors", default=None,
                   help=f"comma list of {list(ANCHORS)}, or 'none' (default: torch_experts,dense_mm, and "
                        "dense_mm_fp8 with --dtype fp8)")
    p.add_argument("--runs", type=int, default=MIN_GPU_RUNS, help=f"timed graph replays per round (>= {MIN_GPU_RUNS})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", "--out", dest="result_dir", type=Path, default=Path("benchmarks/results"),
                   help="folder for the JSON and PNG")
    p.add_argument("--name", default=None, help="file stem (default moe-<dtype>-<gpu>; moe-smoke with --smoke)")
    p.add_argument("--git-sha", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (reference path): checks the script")


def register(subparsers) -> argparse.ArgumentParser:
    return register_suite(subparsers, "moe", "fused mixture-of-experts kernel benchmark", add_arguments, run)


def parse_fp8_block(text: str) -> tuple[int, int] | None:
    if text == "channel":
        return None
    block = parse_ints(text, "--fp8-block")
    if len(block) != 2:
        raise ConfigError(f"invalid --fp8-block={text!r}: expected bn,bk or 'channel'")
    return block[0], block[1]


def build_ctx(args: argparse.Namespace, device: torch.device, ceilings: dict, shapes: list[Shape]) -> Ctx:
    routings = tuple(r.strip() for r in args.routing.split(",") if r.strip())
    bad = [r for r in routings if r not in ROUTINGS]
    if bad or not routings:
        raise ConfigError(f"invalid --routing={args.routing!r}: expected a comma list of {list(ROUTINGS)}")
    if args.anchors is None:
        anchors = ANCHORS if args.dtype == "fp8" else ("torch_experts", "dense_mm")
    elif args.anchors.strip() in ("", "none"):
        anchors = ()
    else:
        anchors = tuple(a.strip() for a in args.anchors.split(","))
    if any(a not in ANCHORS for a in anchors):
        raise ConfigError(f"invalid --anchors={args.anchors!r}: expected a comma list of {list(ANCHORS)} or 'none'")
    if args.zipf_s <= 0:
        raise ConfigError(f"invalid --zipf-s={args.zipf_s}: expected > 0")
    batches = parse_ints(args.batch, "--batch") if args.batch else (SMOKE_BATCHES if args.smoke else BATCHES)
    runs = 5 if args.smoke else args.runs
    fp8_block = parse_fp8_block(args.fp8_block or ("16,16" if args.smoke else "128,128"))
    if args.dtype == "fp8" and fp8_block is not None:
        bad_shapes = [s.name for s in shapes if s.I % fp8_block[0]]
        if bad_shapes:
            raise ConfigError(f"invalid --fp8-block={args.fp8_block or ','.join(map(str, fp8_block))}: block FP8 needs "
                              f"I to be a multiple of bn={fp8_block[0]} (gate and up rows keep their own scale "
                              f"blocks), not so for {bad_shapes}; use another block or 'channel'")
    return Ctx(device=device, dtype=args.dtype, fp8_block=fp8_block, runs=runs,
               routings=routings, batches=batches, anchors=anchors, zipf_s=args.zipf_s, seed=args.seed,
               ceilings=ceilings)


def run(args: argparse.Namespace) -> int:
    t_run = time.time()
    if not args.smoke and not torch.cuda.is_available():
        raise ConfigError("kestrel bench moe needs a CUDA GPU; --smoke runs the CPU check of this script")
    if not args.smoke and args.runs < MIN_GPU_RUNS:
        raise ConfigError(f"invalid --runs={args.runs}: BENCHMARKS.md asks for the median of >= {MIN_GPU_RUNS} runs")
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.dtype == "fp8":
        fn = fp8_entry(device)
        missing = fp8_missing(fn)
        if missing:
            raise ConfigError(f"--dtype fp8: {fn.__module__}.{fn.__qualname__} takes no {', '.join(missing)} "
                              "keyword (this tree's fused MoE has no FP8 weight path yet); use --dtype bf16")
    shapes = parse_shapes(args.shape, args.smoke)
    env = environment(device, args.git_sha)
    log(f"env: {env}")
    ctx = build_ctx(args, device, {}, shapes)  # every flag checked before any device work
    ceilings = ctx.ceilings = gemm_bench.measure_ceilings(device)
    log(f"ceilings: copy {ceilings['bw'] / 1e12:.2f} TB/s, bf16 {ceilings['bf16'] / 1e12:.0f}, "
        f"8-bit {ceilings['eight_bit'] / 1e12:.0f} TFLOP/s{'' if ceilings.get('measured') else ' (fallback)'}")
    gpu = "".join(ch if ch.isalnum() else "_" for ch in env["gpu"].lower().removeprefix("nvidia ")).strip("_")
    stem = args.name or ("moe-smoke" if args.smoke else f"moe-{args.dtype}-{gpu}")
    args.result_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.result_dir / f"{stem}.json"
    result: dict[str, Any] = {
        "suite": "moe", "environment": env, "ceilings": ceilings,
        "config": {
            "shapes": {s.name: asdict(s) for s in shapes}, "batches": list(ctx.batches), "routings": list(ctx.routings),
            "zipf_s": ctx.zipf_s, "seed": ctx.seed, "dtype": ctx.dtype, "activation": ACTIVATION,
            "fp8_block": (list(ctx.fp8_block) if ctx.fp8_block else "channel") if ctx.fp8 else None,
            "anchors": list(ctx.anchors),
            "runs": ctx.runs, "rotate_bytes": ROTATE_BYTES, "err_limits": ERR_LIMIT, "smoke": args.smoke,
            "timing": ("CUDA graph of one call per rotated input set; median of runs replays; the faster of two rounds"
                       if device.type == "cuda" else "perf_counter on the CPU (development only)"),
            "bytes": "distinct experts' weights (+ FP8 scales) + x read + output written + routing read",
            "flops": "2 * T * k * (2I*H + I*H)",
            "x_roofline": "us / max(bytes / copy bandwidth, flops / peak)",
        },
    }

    def save(rows: list[dict]) -> None:  # after every point, so a cut-off run still leaves its numbers
        result["results"] = rows
        json_path.write_text(json.dumps(result, indent=1) + "\n")

    rows = bench(ctx, shapes, on_point=save)
    save(rows)
    plotted = plot(result, json_path.with_suffix(".png"))
    log(f"wrote {json_path}" + (" and .png" if plotted else " (no matplotlib: no PNG)"))
    log(f"total {time.time() - t_run:.0f}s")
    print(summary_table(rows, ceilings), flush=True)
    failed = [r for r in rows if r["status"] != "ok"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("moe", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
