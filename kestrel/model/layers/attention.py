"""The attention layer: write this step's K/V into the paged cache (rotating q and k on the way when given the
rotary embedding), then attend over it."""

from __future__ import annotations

import torch
from torch import nn

from kestrel import ops
from kestrel.kv_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Holds one layer's KV cache `[2, num_blocks, block_size, num_kv_heads, head_size]` (K then V),
    bound by the model runner with `bind_kv_cache`; not a buffer, so it never enters a state dict.

    `cache_spec` declares what the layer caches; the runner groups layers by it and tells each layer its group
    when binding, and the layer writes and reads through that group's slot mapping and block table. `prefix`:
    the layer's checkpoint name (e.g. "model.layers.3.self_attn"), under which its FP8 KV scales are stored."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, layer_idx: int = 0, logit_soft_cap: float | None = None,
                 prefix: str | None = None) -> None:
        """`logit_soft_cap`: scores become cap * tanh(s / cap)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        if logit_soft_cap is not None and logit_soft_cap <= 0:
            raise ValueError(f"logit_soft_cap={logit_soft_cap} must be > 0 or None")
        self.logit_soft_cap = logit_soft_cap
        self.layer_idx = layer_idx
        self.prefix = prefix
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def cache_spec(self) -> KVCacheSpec:
        if self.sliding_window is not None:
            return SlidingWindowSpec(self.num_kv_heads, self.head_size, window=self.sliding_window)
        return FullAttentionSpec(self.num_kv_heads, self.head_size)

    def bind_kv_cache(self, kv_cache: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                      group: int = 0) -> None:
        """Bind the layer's cache, its FP8 scales, and its KV-cache group (whose tables it uses each step)."""
        spec = self.cache_spec
        if not isinstance(spec, FullAttentionSpec):
            raise NotImplementedError(
                f"layer {self.layer_idx}: a {spec.kind} KV cache ({spec}) is not supported by the attention backend "
                "yet; only full and sliding-window attention are")
        expected = (2, self.num_kv_heads, self.head_size)
        if kv_cache.dim() != 5 or (kv_cache.shape[0], *kv_cache.shape[3:]) != expected:
            raise ValueError(
                f"layer {self.layer_idx}: KV cache of shape {tuple(kv_cache.shape)} does not match "
                f"[2, num_blocks, block_size, {self.num_kv_heads}, {self.head_size}]"
            )
        if group < 0:
            raise ValueError(f"layer {self.layer_idx}: KV-cache group {group} must be >= 0")
        self.kv_cache = kv_cache
        self.kv_group = group
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata,
                positions: torch.Tensor | None = None, rotary_emb: RotaryEmbedding | None = None) -> torch.Tensor:
        """q `[T, H*D]`, k and v `[T, H_kv*D]` -> `[T, H*D]`. With `rotary_emb` (and `positions`), q and k are
        rotated first, in the same launch as the KV write (`ops.rope_store_kv`)."""
        if self.kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_idx} has no KV cache; the model runner must call "
                "bind_kv_cache() on every layer of model.attention_layers() before forward()"
            )
        num_tokens = q.shape[0]
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        if self.kv_group == 0:
            slot_mapping, block_tables = attn_metadata.slot_mapping, attn_metadata.block_tables
        else:
            tables = attn_metadata.for_group(self.kv_group)
            slot_mapping, block_tables = tables.slot_mapping, tables.block_tables
        if rotary_emb is None:
            k = k.view(num_tokens, self.num_kv_heads, self.head_size)
            v = v.view(num_tokens, self.num_kv_heads, self.head_size)
            ops.store_kv(k, v, k_cache, v_cache, slot_mapping, self.k_scale, self.v_scale)
        else:
            if positions is None:
                raise ValueError(f"attention layer {self.layer_idx}: rotary_emb given without positions")
            q = rotary_emb.rotate_and_store_kv(positions, q, k, v, k_cache, v_cache, slot_mapping,
                                               self.k_scale, self.v_scale)
        out = ops.paged_attention(
            q.view(num_tokens, self.num_heads, self.head_size), k_cache, v_cache, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, block_tables, self.scale, self.sliding_window, self.k_scale,
            self.v_scale, max_query_len=attn_metadata.max_query_len, logit_soft_cap=self.logit_soft_cap,
        )
        return out.view(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"sliding_window={self.sliding_window}")
