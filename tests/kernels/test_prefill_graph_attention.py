"""The Triton paged attention over a prefill CUDA graph's padded layout (kestrel.worker.prefill_graph): max_query_len
is the token bucket, a bound rather than the longest row, over several rows of which some are short enough for the
decode launch, plus the pad row and empty rows. Real tokens must equal a float64 oracle of the unpadded step
(interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.attention import AttnConfig, paged_attention
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.input_batch import ModelInputs
from kestrel.worker.prefill_graph import PrefillBuckets, PrefillBuffers

BLOCK_SIZE = 16
SMALL_DECODE = AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
SMALL_PREFILL = AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64: q `[Lq, H, D]` are the last Lq positions of k/v `[L, H_kv, D]`."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv)


@pytest.mark.parametrize("rows,tiles", [
    # (context, query tokens) per row: a prompt, decodes (1 and 2 tokens: the decode launch) and a chunk over
    # cached context; 62 tokens pad to the 64 bucket (pad row of 2), 5 rows to the 8 bucket (2 empty rows)
    ([(37, 37), (45, 1), (58, 21), (3, 1), (29, 2)], "small"),
    # one 3-token prompt alone in the 16 bucket: the decode launch must still run with max_query_len = 16
    ([(3, 3)], "default"),
])
def test_padded_graph_layout_matches_the_unpadded_step(device: torch.device, rows, tiles: str) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head = 8, 2, 64
    num_blocks = sum(-(-ctx // BLOCK_SIZE) for ctx, _ in rows) + 2
    # Unwritten blocks (block 0, read by the pad row, included) hold random values: only pad outputs see them.
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head, generator=g)
    free = list(range(1, num_blocks))
    width = max(-(-ctx // BLOCK_SIZE) for ctx, _ in rows)
    tables = torch.zeros(len(rows), width, dtype=torch.int32)
    for r, (ctx, _) in enumerate(rows):
        tables[r, : -(-ctx // BLOCK_SIZE)] = torch.tensor([free.pop() for _ in range(-(-ctx // BLOCK_SIZE))])
    counts = [n for _, n in rows]
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = sum(counts)
    meta = AttentionMetadata(torch.full((num_tokens,), -1), starts, torch.tensor([c for c, _ in rows],
                             dtype=torch.int32), tables, max(counts), max(c for c, _ in rows))
    step = ModelInputs(torch.zeros(num_tokens, dtype=torch.int64), torch.zeros(num_tokens, dtype=torch.int64), meta,
                       starts[1:] - 1, list(range(len(rows))))
    buckets = PrefillBuckets((16, 32, 64), (2, 8))
    tokens, num_rows = buckets.key_for(counts)
    buffers = PrefillBuffers(buckets, max(width, 64 // BLOCK_SIZE), torch.device("cpu"))
    buffers.load(step, tokens, num_rows)
    pm = buffers.metadata(tokens, num_rows)
    q = torch.randn(tokens, heads, head, generator=g)
    cfgs = dict(decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL) if tiles == "small" else {}
    out = paged_attention(q.to(device), k_cache.to(device), v_cache.to(device), pm.query_start_loc.to(device),
                          pm.seq_lens.to(device), pm.block_tables.to(device), head**-0.5,
                          max_query_len=pm.max_query_len, **cfgs).cpu()
    assert pm.max_query_len == tokens and pm.num_seqs == num_rows > len(rows)
    for r, (ctx, n) in enumerate(rows):
        blocks = tables[r, : -(-ctx // BLOCK_SIZE)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head)[:ctx]
        v = v_cache[blocks].reshape(-1, kv_heads, head)[:ctx]
        got = out[starts[r]: starts[r + 1]].double()
        expected = oracle(q[starts[r]: starts[r + 1]], k, v, head**-0.5)
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5, f"row {r} ({ctx}, {n})"
