"""The one dispatch point: CUDA tensors go to Triton kernels, everything else to the PyTorch references.

Callers never test the device themselves; they call `kestrel.ops.<op>` with the reference's signature.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kestrel.kernels import activation as _activation
from kestrel.kernels import attention as _attention
from kestrel.kernels import block_fp8_mm as _block_fp8_mm
from kestrel.kernels import fused_moe as _fused_moe
from kestrel.kernels import gemv as _gemv
from kestrel.kernels import moe_routing as _moe_routing
from kestrel.kernels import norm as _norm
from kestrel.kernels import quant_act as _quant_act
from kestrel.kernels import rope_kv as _rope_kv
from kestrel.kernels import scaled_mm as _scaled_mm
from kestrel.kernels import sparse_decode as _sparse_decode
from kestrel.kernels import store_kv as _store_kv
from kestrel.kernels import streaming_attention as _streaming_attention
from kestrel.kernels import token_bitmask as _token_bitmask
from kestrel.kernels import wna16 as _wna16
from kestrel.kernels.activation import ACTIVATIONS, HF_ACTIVATIONS  # noqa: F401 - the layers' names
from kestrel.kernels.compile_ahead import (  # noqa: F401 - the runner's
    compile_ahead,
    default_workers,
    discard_early_pool,
    start_pool,
    start_pool_early,
    stop_pool,
)
from kestrel.kernels.cpu import attention as _cpu_attention
from kestrel.kernels.cpu import elementwise as _cpu_elementwise
from kestrel.kernels.cpu import linear as _cpu_linear
from kestrel.kernels.cpu import rope_kv as _cpu_rope_kv
from kestrel.kernels.cpu import wna16 as _cpu_wna16
from kestrel.kernels.sparse_decode import key_bounds_dtype, score_scale  # noqa: F401 - the KV cache's, the layers'

# Weight-only (W4A16 / W8A16) checkpoint repacking, for the loaders: run once at load, on any device.
from kestrel.kernels.wna16 import (  # noqa: F401
    WNA16Weight,
    dequantize_wna16,
    pack_wna16,
    repack_awq,
    repack_compressed_tensors,
    repack_fp4,
    repack_gptq,
)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and triton_available()


_cpu_references = False  # set only by `cpu_references()`


@contextlib.contextmanager
def cpu_references() -> Iterator[None]:
    """Within it, CPU tensors take the plain references instead of the fast CPU paths (`kernels/cpu/`): the
    baseline of the CPU benchmarks. Not for serving threads: the switch is process-wide."""
    global _cpu_references
    previous, _cpu_references = _cpu_references, True
    try:
        yield
    finally:
        _cpu_references = previous


def use_cpu_fast_path(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and not _cpu_references


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window=None,
                    k_scale=1.0, v_scale=1.0, out=None, max_query_len=None, logit_soft_cap=None, causal_ends=None,
                    new_kv=None):
    """`max_query_len` (a host int bounding every sequence's query length, AttentionMetadata's) lets the
    Triton path skip launches a batch cannot need; the reference ignores it. `logit_soft_cap` (Gemma 2):
    scaled scores become `cap * tanh(scores / cap)` before masking. `causal_ends` (AttentionMetadata's): each
    query row's end of visible keys, past its own position inside an image that attends to itself both ways.
    `new_kv`: the step's own K/V as written, staged in token order (`rope_store_kv(staged=...)`): the same values
    as the cache's, which the Triton prefill launch reads whole-tile (`reads_staged_kv`) and the others from the
    cache."""
    if use_triton(q):
        return _attention.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                          sliding_window, k_scale, v_scale, out, logit_soft_cap,
                                          max_query_len=max_query_len, causal_ends=causal_ends, new_kv=new_kv)
    if use_cpu_fast_path(q):
        return _cpu_attention.paged_attention_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                  scale, sliding_window, k_scale, v_scale, out, logit_soft_cap,
                                                  causal_ends)
    return _attention.paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                          sliding_window, k_scale, v_scale, out, logit_soft_cap, causal_ends)


def streaming_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sink_tokens, window,
                        cos_cache, sin_cache, rotary_dim, k_scale=1.0, v_scale=1.0, out=None, logit_soft_cap=None):
    """Attention sinks + window with positions inside the cache over un-rotated cached keys
    (kernels/streaming_attention.py). No Triton kernel: every device runs the batched PyTorch version (it reads the
    batch's lengths on the host, so it is not captured in CUDA graphs); float64 and `cpu_references` the reference."""
    reference = q.dtype == torch.float64 or (q.device.type == "cpu" and not use_cpu_fast_path(q))
    fn = _streaming_attention.streaming_attention_ref if reference else _streaming_attention.streaming_attention
    return fn(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sink_tokens, window, cos_cache,
              sin_cache, rotary_dim, k_scale, v_scale, out, logit_soft_cap)


def update_key_bounds(k_cache, slot_mapping, key_bounds, k_scale=1.0) -> None:
    """Quest's per-page key minima and maxima of the blocks this step wrote (kernels/sparse_decode.py)."""
    fn = _sparse_decode.update_key_bounds if use_triton(k_cache) else _sparse_decode.update_key_bounds_ref
    fn(k_cache, slot_mapping, key_bounds, k_scale)


def quest_select(q, key_bounds, seq_lens, block_tables, scale, block_size, num_selected, sink_blocks, recent_blocks):
    """Selected logical pages `[num_seqs, num_kv_heads, num_selected]` (ascending, -1 unused) of a decode batch; the
    page size is the key bounds' (block_size // key_bounds.shape[1])."""
    fn = _sparse_decode.quest_select if use_triton(q) else _sparse_decode.quest_select_ref
    return fn(q, key_bounds, seq_lens, block_tables, scale, block_size, num_selected, sink_blocks, recent_blocks)


def sparse_paged_decode(q, k_cache, v_cache, seq_lens, block_tables, selected, scale, k_scale=1.0, v_scale=1.0,
                        out=None, page_size=None):
    """Decode attention (one query token per sequence) over each (sequence, KV head)'s selected pages (of
    `page_size` tokens; None: whole blocks)."""
    fn = _sparse_decode.sparse_paged_decode if use_triton(q) else _sparse_decode.sparse_paged_decode_ref
    return fn(q, k_cache, v_cache, seq_lens, block_tables, selected, scale, k_scale, v_scale, out, page_size=page_size)


def linear(x, weight, bias=None, packed=None):
    """`F.linear` of the model dtype's layers (unquantized linears, the LM head); on the CPU float32 goes through
    oneDNN on a few row buckets (kernels/cpu/linear.py), from the layer's packed weight when it keeps one
    (`pack_linear_weight`)."""
    if use_cpu_fast_path(x):
        return _cpu_linear.linear_cpu(x, weight, bias, packed)
    return F.linear(x, weight, bias)


def pack_linear_weight(weight):
    """A CPU float32 weight in oneDNN's blocked layout for `linear(packed=...)` (which the CPU references, when
    selected, leave unused); None on other devices and dtypes."""
    return _cpu_linear.pack_weight(weight) if weight.device.type == "cpu" else None


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    if use_triton(key):
        fn = _store_kv.store_kv
    else:
        fn = _cpu_rope_kv.store_kv_cpu if use_cpu_fast_path(key) else _store_kv.store_kv_ref
    fn(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rope_store_kv(positions, q, k, v, cos_cache, sin_cache, rotary_dim, k_cache, v_cache, slot_mapping, k_scale=1.0,
                  v_scale=1.0, head_norms=None, staged=None):
    """`head_norms` (`HeadNorms`): q's and k's per-head RMSNorms, applied first (in the same launch on the GPU).
    `staged` (`new_staged_kv`'s pair): filled with the K/V rows as written, in token order, for `paged_attention`'s
    `new_kv` (in the same launch on the GPU)."""
    if use_triton(q):
        return _rope_kv.rope_store_kv(positions, q, k, v, cos_cache, sin_cache, rotary_dim, k_cache, v_cache,
                                      slot_mapping, k_scale, v_scale, head_norms, staged)
    if head_norms is not None:
        q, k = apply_head_norms(q, k, head_norms, k_cache.shape[-1])
    fn = _cpu_rope_kv.rope_store_kv_cpu if use_cpu_fast_path(q) else _rope_kv.rope_store_kv_ref
    out = fn(positions, q, k, v, cos_cache, sin_cache, rotary_dim, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _rope_kv.fill_staged(staged, k_cache, v_cache, slot_mapping)
    return out


def reads_staged_kv(q, k_cache, v_cache):
    """Whether `paged_attention`'s prefill launch over these caches reads `new_kv` (Triton on a GPU with TMA)."""
    return use_triton(q) and _attention.reads_staged_kv(q, k_cache, v_cache)


new_staged_kv = _attention.new_staged_kv


HeadNorms = _rope_kv.HeadNorms


def apply_head_norms(q, k, head_norms, head_size):
    """q and k (`[T, heads * head_size]`) with each head RMS-normalised by `head_norms` (`HeadNorms`)."""
    return _rope_kv.head_norms_ref(q, k, head_norms, head_size, rms_norm=rms_norm)


def rms_norm(x, weight, eps, residual=None, unit_offset=False):
    """`unit_offset`: Gemma's `norm(x) * (1 + weight)` in fp32, rounded once to x's dtype."""
    if use_triton(x):
        fn = _norm.rms_norm
    else:
        fn = _cpu_elementwise.rms_norm_cpu if use_cpu_fast_path(x) else _norm.rms_norm_ref
    return fn(x, weight, eps, residual, unit_offset)


def layer_norm(x, weight, bias, eps, residual=None):
    fn = _norm.layer_norm if use_triton(x) else _norm.layer_norm_ref
    return fn(x, weight, bias, eps, residual)


def act_mul(x, activation):
    """`act(gate) * up` for x `[..., 2*I]`; activation in `kernels.activation.ACTIVATIONS`."""
    if use_triton(x):
        fn = _activation.act_mul
    else:
        fn = _cpu_elementwise.act_mul_cpu if use_cpu_fast_path(x) else _activation.act_mul_ref
    return fn(x, activation)


def act(x, activation):
    fn = _activation.act if use_triton(x) else _activation.act_ref
    return fn(x, activation)


def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, azp_adj=None, azp=None):
    fn = _scaled_mm.scaled_mm if use_triton(a) else _scaled_mm.scaled_mm_ref
    return fn(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)


def scaled_mm_gated(a, b, scale_a, scale_b, out_dtype, activation="silu", bias=None):
    """`act(gate) * up` of the W8A8-FP8 gate/up GEMM (b: gate rows, then up rows) in one launch
    (kernels/scaled_mm.py)."""
    fn = _scaled_mm.scaled_mm_gated if use_triton(a) else _scaled_mm.scaled_mm_gated_ref
    return fn(a, b, scale_a, scale_b, out_dtype, activation, bias)


def gemv(x, weight, weight_scale, out_dtype, bias=None, *, config=None):
    """`x [M, K] @ (weight * weight_scale).T + bias` for a 16-bit weight `[N, K]` (no scale) or a float8_e4m3fn one
    with its scale, model-dtype x (W8A16 for FP8), fp32 accumulation rounded once: the decode-sized GEMV of linear
    layers (kernels/gemv.py)."""
    fn = _gemv.gemv if use_triton(x) else _gemv.gemv_ref
    return fn(x, weight, weight_scale, out_dtype, bias, config=config)


def quant_fp8_per_token(x):
    fn = _quant_act.quant_fp8_per_token if use_triton(x) else _quant_act.quant_fp8_per_token_ref
    return fn(x)


def quant_fp8_per_group(x, group):
    """(e4m3 `[M, K]`, fp32 scales `[M, ceil(K / group)]`): x `[M, K]` quantized per token and `group` input
    features, each group by its own absolute max (the per-token quantizer over rows of `group` values; a last
    group shorter than `group` padded with zeros, which leave its max as it is)."""
    M, K = x.shape
    groups = -(-K // group)
    padded = x if groups * group == K else F.pad(x, (0, groups * group - K))
    q, scale, _ = quant_fp8_per_token(padded.reshape(M * groups, group))
    return q.reshape(M, groups * group)[:, :K], scale.reshape(M, groups)


block_fp8_k_step = _block_fp8_mm.k_step


def block_fp8_mm(a, b, scale_a, scale_b, group, out_dtype, bias=None):
    """The W8A8 block GEMM (kernels/block_fp8_mm.py): e4m3 `a [M, K]` and `b [N, K]`, fp32 scales per token
    (output row) and `group` input features."""
    fn = _block_fp8_mm.block_fp8_mm if use_triton(a) else _block_fp8_mm.block_fp8_mm_ref
    return fn(a, b, scale_a, scale_b, group, out_dtype, bias)


def quant_int8_per_token(x, symmetric=True):
    fn = _quant_act.quant_int8_per_token if use_triton(x) else _quant_act.quant_int8_per_token_ref
    return fn(x, symmetric)


def quant_static(x, scale, dtype, azp=None):
    fn = _quant_act.quant_static if use_triton(x) else _quant_act.quant_static_ref
    return fn(x, scale, dtype, azp)


def rms_norm_quant(x, weight, eps, dtype, residual=None, scale=None, azp=None, symmetric=True, unit_offset=False):
    fn = _quant_act.rms_norm_quant if use_triton(x) else _quant_act.rms_norm_quant_ref
    return fn(x, weight, eps, dtype, residual, scale, azp, symmetric, unit_offset)


def act_mul_quant(x, activation, dtype, scale=None, azp=None, symmetric=True):
    fn = _quant_act.act_mul_quant if use_triton(x) else _quant_act.act_mul_quant_ref
    return fn(x, activation, dtype, scale, azp, symmetric)


def act_quant(x, activation, dtype, scale=None, azp=None, symmetric=True):
    fn = _quant_act.act_quant if use_triton(x) else _quant_act.act_quant_ref
    return fn(x, activation, dtype, scale, azp, symmetric)


def fused_moe(x, w13, w2, topk_weights, topk_ids, activation="silu", *, w13_scale=None, w2_scale=None,
              block_shape=None, reduce_inter_amax=None):
    """Mixture-of-experts MLP: `sum_j topk_weights[:, j] * w2[e] @ (act(w13[e, :I] @ x) * (w13[e, I:] @ x))`,
    `e = topk_ids[:, j]` (pairs with id -1 skipped); w13 `[E, 2*I, H]` (gate rows, then up), w2 `[E, H, I]`.
    FP8 experts: float8_e4m3fn w13 / w2 with fp32 `w13_scale` / `w2_scale`, per channel (`[E, 2I]`, `[E, H]`)
    or, with `block_shape=(bn, bk)`, per block (`[E, 2I/bn, H/bk]`, `[E, H/bn, I/bk]`); activations are
    quantized per token (per token and bk-column group) inside. `reduce_inter_amax`: per-channel FP8 experts
    whose intermediate dimension is split over ranks quantize it with the row absmax this reduces (the group max)."""
    fn = _fused_moe.fused_moe if use_triton(x) else _fused_moe.fused_moe_ref
    return fn(x, w13, w2, topk_weights, topk_ids, activation, w13_scale=w13_scale, w2_scale=w2_scale,
              block_shape=block_shape, reduce_inter_amax=reduce_inter_amax)


# ValueError naming what a router of that many experts cannot do (its scoring, groups, top-k).
check_moe_routing = _moe_routing.check_routing


def moe_route(logits, top_k, renormalize, scoring="softmax", num_groups=1, topk_groups=1):
    """(weights fp32 [T, k], expert ids int64 [T, k]): each token's `top_k` experts by the `scoring` ("softmax" or
    "sigmoid") of its router logits `[T, E]`, in descending weight order, the weights renormalised to sum to 1 when
    `renormalize`; with `num_groups` > 1, chosen among the experts of its `topk_groups` best groups."""
    fn = _moe_routing.route_topk if use_triton(logits) else _moe_routing.route_topk_ref
    return fn(logits, top_k, renormalize, scoring, num_groups, topk_groups)


def moe_route_gemv(x, router_weight, top_k, renormalize, *, config, scoring="softmax"):
    """`moe_route(x @ router_weight.T, ...)` (ungrouped) for a 16-bit router whose decode GEMV (kernels/gemv.py,
    `config`) runs these rows: the logits rounded to x's dtype, then each row's top-k, in the GEMV's own launch
    where the GPU runs the `router_topk` launch feature."""
    fn = _gemv.gemv_route if use_triton(x) else _gemv.gemv_route_ref
    return fn(x, router_weight, top_k, renormalize, config=config, scoring=scoring)


def apply_token_bitmask(logits, bitmask, rows):
    """Mask `logits[rows[i]]` in place by the grammar bitmask `bitmask[i]` (xgrammar's int32 layout): disallowed
    tokens, and tokens past the mask, get -inf. Returns `logits`."""
    fn = _token_bitmask.apply_token_bitmask if use_triton(logits) else _token_bitmask.apply_token_bitmask_ref
    return fn(logits, bitmask, rows)


def wna16_gemm(x, qweight, scales, zeros, perm, weight_type, out_dtype, bias=None):
    """Weight-only GEMM `x [M, K] @ W^T -> [M, N]` with 4- or 8-bit weights in the layout `repack_*` / `pack_wna16`
    produce (`kernels/wna16.py`); call it as `wna16_gemm(x, *weight, out_dtype, bias)` with a `WNA16Weight`."""
    if use_triton(x):
        fn = _wna16.wna16_gemm
    elif use_cpu_fast_path(x):
        fn = _cpu_wna16.wna16_gemm_cpu
    else:
        fn = _wna16.wna16_gemm_ref
    return fn(x, qweight, scales, zeros, perm, weight_type, out_dtype, bias)
