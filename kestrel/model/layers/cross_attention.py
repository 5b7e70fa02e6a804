"""Cross-attention over an encoder's output kept in the paged KV cache (`CrossAttentionSpec`): the encoder's K/V are
written once per request, into the request's blocks of the cross-attention group (`store_encoder_kv`), and every
decoder step reads all of them, unmasked.

The read reuses the paged attention op: each query token becomes a one-token sequence whose context is the whole
encoder output (block table row of its request, length `max_encoder_len`), so no causal mask applies."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel import ops
from kestrel.kv_spec import CrossAttentionSpec
from kestrel.model.attn_metadata import AttentionMetadata


@dataclass(frozen=True)
class CrossReads:
    """A step's cross-attention reads, one sequence per query token (`CrossAttention.read_tables`)."""

    block_tables: torch.Tensor  # int32 [T, blocks of the encoder output]
    query_start_loc: torch.Tensor  # int32 [T + 1]: 0, 1, .., T
    seq_lens: torch.Tensor  # int32 [T]: max_encoder_len each


class CrossAttention(nn.Module):
    """One decoder layer's cross-attention cache `[2, num_blocks, block_size, num_heads, head_size]` (K then V),
    bound by the runner like `Attention`'s, in the cross-attention group."""

    def __init__(self, num_heads: int, head_size: int, scale: float, max_encoder_len: int, layer_idx: int = 0,
                 prefix: str | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.max_encoder_len = max_encoder_len
        self.layer_idx = layer_idx
        self.prefix = prefix
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def cache_spec(self) -> CrossAttentionSpec:
        return CrossAttentionSpec(self.num_kv_heads, self.head_size, self.max_encoder_len)

    def bind_kv_cache(self, kv_cache: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                      group: int = 0) -> None:
        expected = (2, self.num_kv_heads, self.head_size)
        if kv_cache.dim() != 5 or (kv_cache.shape[0], *kv_cache.shape[3:]) != expected:
            raise ValueError(f"cross-attention layer {self.layer_idx}: KV cache of shape {tuple(kv_cache.shape)} "
                             f"does not match [2, num_blocks, block_size, {self.num_kv_heads}, {self.head_size}]")
        self.kv_cache, self.kv_group = kv_cache, group
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    def _cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(f"cross-attention layer {self.layer_idx} has no KV cache; the model runner must bind "
                               "one before the encoder's K/V are stored or read")
        return self.kv_cache

    def encoder_slots(self, block_ids: list[list[int]], device: torch.device) -> torch.Tensor:
        """The cache slots of `max_encoder_len` positions of each request (`block_ids`: every group's lists)."""
        size = self._cache().shape[2]
        positions = torch.arange(self.max_encoder_len)
        tables = torch.tensor([ids[self.kv_group][: -(-self.max_encoder_len // size)] for ids in block_ids],
                              dtype=torch.int64)
        return (tables[:, positions // size] * size + positions % size).reshape(-1).to(device)

    def store_encoder_kv(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v `[R * max_encoder_len, H*D]` (R requests' encoder outputs projected) into `slots`."""
        cache = self._cache()
        shape = (k.shape[0], self.num_kv_heads, self.head_size)
        ops.store_kv(k.reshape(shape), v.reshape(shape), cache[0], cache[1], slots, self.k_scale, self.v_scale)

    def read_tables(self, attn_metadata: AttentionMetadata, num_tokens: int) -> CrossReads:
        """The step's reads as one-token sequences: each query token's block table row (its request's), query
        starts 0..T and lengths `max_encoder_len`. The same for every layer of the group: computed once a step."""
        tables = attn_metadata.for_group(self.kv_group).block_tables
        device = tables.device
        starts = attn_metadata.query_start_loc
        lengths = (starts[1:] - starts[:-1]).long()
        token_seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths,
                                            output_size=num_tokens)
        needed = -(-self.max_encoder_len // self._cache().shape[2])
        if tables.shape[1] < needed:  # a step whose widest group is narrower (the memory profile's tables)
            tables = F.pad(tables, (0, needed - tables.shape[1]))
        return CrossReads(tables.index_select(0, token_seq),
                          torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
                          torch.full((num_tokens,), self.max_encoder_len, dtype=torch.int32, device=device))

    def forward(self, q: torch.Tensor, reads: CrossReads) -> torch.Tensor:
        """q `[T, H*D]` -> `[T, H*D]`: every query token attends to all of its request's encoder positions."""
        cache = self._cache()
        num_tokens = q.shape[0]
        out = ops.paged_attention(q.view(num_tokens, self.num_heads, self.head_size), cache[0], cache[1],
                                  reads.query_start_loc, reads.seq_lens, reads.block_tables, self.scale, None,
                                  self.k_scale, self.v_scale, max_query_len=1)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_size={self.head_size}, max_encoder_len={self.max_encoder_len}"
