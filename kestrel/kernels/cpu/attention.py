"""Paged attention on the CPU: `paged_attention_ref`'s semantics without its per-sequence Python loop.

Float32 queries and output over a float32 or bf16 cache (contiguous, no `causal_ends`) go to the C kernel
`paged_attention.c` (built and loaded by `native.py`): it reads each sequence's blocks where they lie in the cache
and keeps an online softmax per query row, so there is no gathered K/V copy, no padding and no mask tensor; a row
visits only the keys it may see. Decode rows take one (row, key) dot at a time; prefill chunks pack up to 32
(query row x group head) rows as vector lanes, so each key tile is read once per group of rows. Work items
(sequence, KV head, rows) run on torch's OpenMP threads (`torch.get_num_threads()`); each item is one thread's, so
the result does not depend on the thread count.

Everything else (FP8 caches, bf16 / fp16 queries, `causal_ends`, or no C compiler) takes the PyTorch path: two
batched calls, one over the decode rows (query length 1) and one over the prefill chunks. Each group gathers its
sequences' blocks with one index into the cache (`[S, blocks, block_size, H_kv, D]`), pads queries to the group's
longest and keys to its longest context, and runs one masked attention: PyTorch's fused
`scaled_dot_product_attention` (its CPU flash kernel), or, with a logit soft cap, which SDPA cannot apply, matmul,
tanh, softmax and matmul. GQA folds the query heads that share a KV head into the query rows (`[S, H_kv, G*Lq, D]`),
so K and V are never repeated. Both compute in float32 like the reference; float64 queries go to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.kernels.attention import _check_soft_cap, paged_attention_ref
from kestrel.kernels.cpu import native

_NATIVE_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    logit_soft_cap: float | None = None,
    causal_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_ref` (same arguments, same result up to float32 summation order)."""
    if q.dtype == torch.float64:
        return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                   sliding_window, k_scale, v_scale, out, logit_soft_cap, causal_ends)
    _check_soft_cap(logit_soft_cap)
    if out is None:
        out = torch.empty_like(q)
    if _native(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, k_scale, v_scale,
               out, logit_soft_cap, causal_ends):
        return out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes: list[int] = []
    prefills: list[int] = []
    for s in range(len(lens)):
        query_len = starts[s + 1] - starts[s]
        if query_len == 1:
            decodes.append(s)
        elif query_len > 1:
            prefills.append(s)
    for seqs in (decodes, prefills):
        if seqs:
            _attend(q, k_cache, v_cache, starts, lens, block_tables, seqs, scale, sliding_window, k_scale, v_scale,
                    out, logit_soft_cap, causal_ends)
    return out


def native_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                   sliding_window: int | None, causal_ends: torch.Tensor | None) -> bool:
    """Whether `paged_attention.c` computes this call: float32 queries and output, a float32 or bf16 cache, all
    contiguous CPU tensors, no `causal_ends`, a window of at least one key."""
    return (causal_ends is None and q.dtype == torch.float32 and out.dtype == torch.float32
            and k_cache.dtype in _NATIVE_CACHE_DTYPES and v_cache.dtype == k_cache.dtype
            and q.device.type == "cpu" and q.dim() == 3 and k_cache.dim() == 4 and out.shape == q.shape
            and v_cache.shape == k_cache.shape and k_cache.shape[3] == q.shape[2]
            and q.shape[1] % k_cache.shape[2] == 0 and (sliding_window is None or sliding_window >= 1)
            and q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, sliding_window: int | None,
            k_scale: float, v_scale: float, out: torch.Tensor, logit_soft_cap: float | None,
            causal_ends: torch.Tensor | None) -> bool:
    """Runs the C kernel into `out` when it applies and is built; False leaves the call to the PyTorch path (also
    when the kernel rejects the block table: a sequence longer than its row, a block id outside the cache)."""
    if not native_applies(q, k_cache, v_cache, out, sliding_window, causal_ends):
        return False
    fn = native.paged_attention_fn()
    if fn is None:
        return False
    qsl, lens, tables = _int32(query_start_loc), _int32(seq_lens), block_tables
    if tables.dtype != torch.int32 or tables.dim() != 2 or tables.stride(1) != 1:
        tables = tables.to(torch.int32).contiguous()
    if lens.numel() == 0 or q.shape[0] == 0:
        return True
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    status = fn(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                int(k_cache.dtype == torch.bfloat16), num_blocks, block_size, q.shape[1], num_kv_heads, head_size,
                qsl.data_ptr(), lens.data_ptr(), tables.data_ptr(), tables.stride(0), tables.shape[1],
                lens.numel(), scale, sliding_window or 0, k_scale, v_scale, logit_soft_cap or 0.0,
                torch.get_num_threads())
    return status == 0


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: list[int], lens: list[int],
            block_tables: torch.Tensor, seqs: list[int], scale: float, sliding_window: int | None, k_scale: float,
            v_scale: float, out: torch.Tensor, logit_soft_cap: float | None,
            causal_ends: torch.Tensor | None = None) -> None:
    """Attention of the sequences `seqs` (indices into the batch), written into their rows of `out`."""
    _, num_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    q_lens = [starts[s + 1] - starts[s] for s in seqs]
    ctx = [lens[s] for s in seqs]
    num_seqs, max_q, max_k = len(seqs), max(q_lens), max(ctx)
    num_blocks = -(-max_k // block_size)
    # Every sequence of the batch with one query length (all decodes, or equal prefill chunks): the rows of q and
    # of the block table are used as they are, with no index and no padded query rows.
    uniform = num_seqs == len(lens) and min(q_lens) == max_q and starts[0] == 0
    if uniform:
        blocks = block_tables[:num_seqs, :num_blocks]
    else:
        blocks = block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=device))[:, :num_blocks]
    # Rows past a sequence's blocks may hold anything (-1 included): clamped, then masked off as keys.
    blocks = blocks.long().clamp_(min=0)
    k = _gather(k_cache, blocks, max_k, k_scale)  # [S, H_kv, Lk, D]
    v = _gather(v_cache, blocks, max_k, v_scale)

    ctx_t = torch.tensor(ctx, dtype=torch.long, device=device).unsqueeze(1)  # [S, 1]
    offs = torch.arange(max_q, device=device).unsqueeze(0)  # [1, Lq]
    if uniform:
        rows = valid_q = None
        qs = q[: num_seqs * max_q].to(torch.float32)
        q_pos = (ctx_t - max_q + offs).unsqueeze(2)  # [S, Lq, 1]
    else:
        q_len_t = torch.tensor(q_lens, dtype=torch.long, device=device).unsqueeze(1)
        start_t = torch.tensor([starts[s] for s in seqs], dtype=torch.long, device=device).unsqueeze(1)
        valid_q = offs < q_len_t  # [S, Lq]
        rows = torch.where(valid_q, start_t + offs, start_t)  # padded rows repeat the sequence's first query row
        qs = q[rows.flatten()].to(torch.float32)  # [S*Lq, H, D]
        q_pos = (ctx_t - q_len_t + offs).unsqueeze(2)
    # [S, Lq, H_kv, G, D] -> [S, H_kv, G*Lq, D]: each KV head's query heads become rows of one attention.
    qs = qs.view(num_seqs, max_q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    qs = qs.reshape(num_seqs, num_kv_heads, group * max_q, head_size)

    k_pos = torch.arange(max_k, device=device).view(1, 1, max_k)
    if causal_ends is None:
        allowed = (k_pos <= q_pos) & (k_pos < ctx_t.unsqueeze(2))
    else:
        # each row's own end (its image's last placeholder + 1), read at the row's index; padded rows read row 0's
        ends = causal_ends.to(device).long()
        ends = ends[: num_seqs * max_q].view(num_seqs, max_q) if rows is None else ends[rows]
        allowed = (k_pos < ends.unsqueeze(2)) & (k_pos < ctx_t.unsqueeze(2))
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    if valid_q is not None:
        # Padded query rows may see no key at all; give them key 0 so nothing divides by zero (they are dropped).
        allowed[:, :, 0] |= ~valid_q
    mask = allowed.unsqueeze(1).expand(num_seqs, group, max_q, max_k).reshape(num_seqs, 1, group * max_q, max_k)

    if logit_soft_cap is None:
        res = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(qs, k.transpose(-1, -2)).mul_(scale / logit_soft_cap).tanh_().mul_(logit_soft_cap)
        scores.masked_fill_(~mask, float("-inf"))
        res = torch.matmul(torch.softmax(scores, dim=-1), v)
    # [S, H_kv, G*Lq, D] -> [S, Lq, H, D]
    res = res.view(num_seqs, num_kv_heads, group, max_q, head_size).permute(0, 3, 1, 2, 4)
    res = res.reshape(num_seqs, max_q, num_heads, head_size)
    if rows is None:
        out[: num_seqs * max_q].copy_(res.reshape(-1, num_heads, head_size))  # every row, in order: no scatter
    else:
        out[rows[valid_q]] = res[valid_q].to(out.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, max_k: int, cache_scale: float) -> torch.Tensor:
    """The blocks' keys or values as float32 `[S, H_kv, Lk, D]`, times the FP8 scale."""
    num_seqs, num_blocks = blocks.shape
    block_size, num_kv_heads, head_size = cache.shape[1:]
    # Rows of whole blocks: index_select copies a 2-D tensor's rows with memcpy, a 4-D one element-wise.
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.flatten())
    x = rows.view(num_seqs, num_blocks * block_size, num_kv_heads, head_size)
    x = x[:, :max_k].to(torch.float32)
    if cache_scale != 1.0:
        x = x * cache_scale
    return x.transpose(1, 2)
