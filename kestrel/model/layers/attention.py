"""The attention layer: write this step's K/V into the paged cache (rotating q and k on the way when given the
rotary embedding), then attend over it."""

from __future__ import annotations

import torch
from torch import nn

from kestrel import ops
from kestrel.config import ConfigError, SparseDecodeConfig, StreamingWindowConfig
from kestrel.kv_spec import FullAttentionSpec, KVCacheSpec, SinkWindowSpec, SlidingWindowSpec
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.rotary import RotaryEmbedding

# Steps whose longest query has at least this many tokens stage their own K/V in token order for the prefill
# attention launch (read whole-tile through TMA); shorter ones gather every key from the cache's blocks, where the
# copy and the descriptors would cost more than they save.
STAGED_KV_MIN_QUERY = 64


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
        # Quest (sparse decoding), bound by the runner on full-attention layers: per-page key bounds
        # `[num_blocks, pages_per_block, 2, num_kv_heads, head_size]` kept as keys are written, and the settings.
        self.key_bounds: torch.Tensor | None = None
        self.sparse_decode: SparseDecodeConfig | None = None
        # Attention sinks + window (streaming_window), bound by the runner before the cache is sized: K is cached
        # un-rotated and q and k are rotated as attention reads them, by their positions inside the cache.
        self.streaming: StreamingWindowConfig | None = None

    @property
    def cache_spec(self) -> KVCacheSpec:
        if self.streaming is not None:
            return SinkWindowSpec(self.num_kv_heads, self.head_size, window=self.streaming.window,
                                  sink_tokens=self.streaming.sink_tokens)
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

    def bind_streaming(self, settings: StreamingWindowConfig) -> None:
        """Attend to the first `sink_tokens` and last `window` tokens with positions inside the cache; called before
        the KV cache is sized (the layer's spec changes)."""
        if self.sliding_window is not None:
            raise ConfigError(f"invalid streaming_window: layer {self.layer_idx} has its own sliding window of "
                              f"{self.sliding_window} tokens, which the sink + window attention does not combine "
                              "with; drop streaming_window for this model")
        if self.kv_cache is not None:
            raise RuntimeError(f"layer {self.layer_idx}: bind streaming before the KV cache (its spec sizes the cache)")
        self.streaming = settings

    def bind_sparse_decode(self, key_bounds: torch.Tensor, settings: SparseDecodeConfig) -> None:
        """Turn on Quest for this layer: keep `key_bounds` (`[num_blocks, pages_per_block, 2, kv_heads, head_size]`,
        the cache's block count, of `ops.key_bounds_dtype(cache dtype)`) as keys are written, and decode over the
        selected pages."""
        if type(self.cache_spec) is not FullAttentionSpec:
            raise ValueError(f"layer {self.layer_idx}: Quest applies to full-attention layers, not {self.cache_spec}")
        if self.logit_soft_cap is not None:
            raise ValueError(f"layer {self.layer_idx}: Quest's kernels do not apply a logit soft cap")
        if self.kv_cache is None or key_bounds.shape != (
                self.kv_cache.shape[1], self.kv_cache.shape[2] // settings.page_tokens(self.kv_cache.shape[2]), 2,
                self.num_kv_heads, self.head_size):
            raise ValueError(f"layer {self.layer_idx}: key bounds {tuple(key_bounds.shape)} do not fit the bound "
                             "KV cache (bind the cache first)")
        self.key_bounds = key_bounds
        self.sparse_decode = settings

    def _runs_sparse(self, attn_metadata: AttentionMetadata) -> bool:
        """Quest runs for a step of one query token per sequence whose longest context exceeds the budget;
        `max_seq_len` 0 means the host does not know it (a captured decode graph), and the selection then keeps
        every block of a context within the budget."""
        settings = self.sparse_decode
        return (settings is not None and attn_metadata.max_query_len == 1
                and (attn_metadata.max_seq_len == 0 or attn_metadata.max_seq_len > settings.token_budget))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata,
                positions: torch.Tensor | None = None, rotary_emb: RotaryEmbedding | None = None,
                head_norms: ops.HeadNorms | None = None) -> torch.Tensor:
        """q `[T, H*D]`, k and v `[T, H_kv*D]` -> `[T, H*D]`. With `rotary_emb` (and `positions`), q and k are
        rotated first, in the same launch as the KV write (`ops.rope_store_kv`). `head_norms`: q's and k's
        per-head RMSNorms, applied before anything else (in that same launch where there is one)."""
        if self.kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_idx} has no KV cache; the model runner must call "
                "bind_kv_cache() on every layer of model.attention_layers() before forward()"
            )
        num_tokens = q.shape[0]
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        new_kv = None  # the step's own K/V staged in token order for the prefill launch (long enough prompts)
        if self.kv_group == 0:
            slot_mapping, block_tables = attn_metadata.slot_mapping, attn_metadata.block_tables
        else:
            tables = attn_metadata.for_group(self.kv_group)
            slot_mapping, block_tables = tables.slot_mapping, tables.block_tables
        if head_norms is not None and (self.streaming is not None or rotary_emb is None):
            q, k = ops.apply_head_norms(q, k, head_norms, self.head_size)
            head_norms = None
        if self.streaming is not None:
            return self._stream(q, k, v, k_cache, v_cache, slot_mapping, block_tables, attn_metadata, rotary_emb)
        if rotary_emb is None:
            k = k.view(num_tokens, self.num_kv_heads, self.head_size)
            v = v.view(num_tokens, self.num_kv_heads, self.head_size)
            ops.store_kv(k, v, k_cache, v_cache, slot_mapping, self.k_scale, self.v_scale)
        else:
            if positions is None:
                raise ValueError(f"attention layer {self.layer_idx}: rotary_emb given without positions")
            if attn_metadata.max_query_len >= STAGED_KV_MIN_QUERY and ops.reads_staged_kv(q, k_cache, v_cache):
                new_kv = ops.new_staged_kv(num_tokens, k_cache)
            q = rotary_emb.rotate_and_store_kv(positions, q, k, v, k_cache, v_cache, slot_mapping,
                                               self.k_scale, self.v_scale, head_norms, new_kv)
        if self.key_bounds is not None:
            ops.update_key_bounds(k_cache, slot_mapping, self.key_bounds, self.k_scale)
            if self._runs_sparse(attn_metadata):
                return self._sparse_decode(q.view(num_tokens, self.num_heads, self.head_size), k_cache, v_cache,
                                           attn_metadata, block_tables).view(num_tokens, -1)
        out = ops.paged_attention(
            q.view(num_tokens, self.num_heads, self.head_size), k_cache, v_cache, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, block_tables, self.scale, self.sliding_window, self.k_scale,
            self.v_scale, max_query_len=attn_metadata.max_query_len, logit_soft_cap=self.logit_soft_cap,
            causal_ends=attn_metadata.causal_ends, new_kv=new_kv,
        )
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _stream(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, attn_metadata: AttentionMetadata,
                rotary_emb: RotaryEmbedding | None) -> torch.Tensor:
        """Sinks + window: K and V written as they are (a key's rotary position, its index in the cache, changes as
        the window slides), attention rotating q and the keys it reads."""
        assert self.streaming is not None
        num_tokens = q.shape[0]
        ops.store_kv(k.view(num_tokens, self.num_kv_heads, self.head_size),
                     v.view(num_tokens, self.num_kv_heads, self.head_size), k_cache, v_cache, slot_mapping,
                     self.k_scale, self.v_scale)
        cos, sin, rotary_dim = ((rotary_emb.cos_cache, rotary_emb.sin_cache, rotary_emb.rotary_dim)
                                if rotary_emb is not None else (None, None, 0))
        out = ops.streaming_attention(
            q.reshape(num_tokens, self.num_heads, self.head_size), k_cache, v_cache, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, block_tables, self.scale, self.streaming.sink_tokens, self.streaming.window, cos,
            sin, rotary_dim, self.k_scale, self.v_scale, logit_soft_cap=self.logit_soft_cap)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _sparse_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       attn_metadata: AttentionMetadata, block_tables: torch.Tensor) -> torch.Tensor:
        """A decode batch: row s is sequence s's one query token (a padded graph row has seq_len 0 and gets
        zeros). Selection, then attention over the selected blocks."""
        settings, block_size = self.sparse_decode, k_cache.shape[1]
        assert settings is not None and self.key_bounds is not None
        seq_lens = attn_metadata.seq_lens
        scale = ops.score_scale(self.key_bounds, self.scale, self.k_scale)
        selected = ops.quest_select(q, self.key_bounds, seq_lens, block_tables, scale, block_size,
                                    settings.num_selected_pages(block_size), settings.sink_blocks,
                                    settings.recent_blocks)
        return ops.sparse_paged_decode(q, k_cache, v_cache, seq_lens, block_tables, selected, self.scale,
                                       self.k_scale, self.v_scale, page_size=settings.page_tokens(block_size))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"sliding_window={self.sliding_window}")
