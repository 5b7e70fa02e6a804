"""What each attention layer keeps in the paged KV cache, and how layers share block tables (pure Python).

A layer declares one spec: full attention, a sliding window of N tokens, a latent vector of width D (MLA-style,
one tensor), cross-attention over an encoder's K/V, or nothing. Layers with equal specs form a `KVCacheGroup`:
they share one block table, and a request holds one block list per group. `KVCacheLayout` is what a worker
reports to the engine: the block size, the groups, and each group's block count.

Byte counts take the cache's element size as an argument, so this module stays free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kestrel.config import ConfigError


def _check_positive(spec: object, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(spec).__name__}: {name}={value!r} must be a positive int")


@dataclass(frozen=True)
class FullAttentionSpec:
    """K and V of every token, `num_kv_heads x head_size` each."""

    num_kv_heads: int
    head_size: int

    kind: ClassVar[str] = "full"
    # Whether the group's blocks follow the sequence's tokens (block j holds positions j*B .. j*B + B - 1), so
    # they can be published to and found in the prefix cache by the tokens' chained hashes.
    follows_tokens: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_positive(self, num_kv_heads=self.num_kv_heads, head_size=self.head_size)

    def bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_kv_heads * self.head_size * element_size

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return block_size * self.bytes_per_token(element_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K and V like full attention, read only for the last `window` positions (the query's own included)."""

    window: int = 0

    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, window=self.window)


@dataclass(frozen=True)
class SinkWindowSpec(SlidingWindowSpec):
    """Attention sinks + a window (StreamingLLM, the engine's `streaming_window`): a query reads the first
    `sink_tokens` positions and the last `window` ones. K is cached un-rotated (rotary positions are indices inside
    the cache, rotated as attention reads them). The group keeps a sequence's first `sink_blocks` blocks; each
    block that falls wholly below the window after them is dropped from the sequence, whose later positions then
    move down by a block, so a stream of any length holds at most `max_blocks_per_request` blocks."""

    sink_tokens: int = 0

    kind: ClassVar[str] = "sink_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"SinkWindowSpec: sink_tokens={self.sink_tokens!r} must be an int >= 0")

    def sink_blocks(self, block_size: int) -> int:
        return -(-self.sink_tokens // block_size)

    def max_blocks_per_request(self, block_size: int) -> int:
        """Sink blocks, the window's (it may start and end mid-block) and the step's new token."""
        return self.sink_blocks(block_size) + -(-self.window // block_size) + 2


@dataclass(frozen=True)
class LatentAttentionSpec:
    """One latent vector of `width` elements per token (MLA: the compressed KV and the rotary key together)."""

    width: int

    kind: ClassVar[str] = "latent"
    follows_tokens: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_positive(self, width=self.width)

    def bytes_per_token(self, element_size: int) -> int:
        return self.width * element_size

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return block_size * self.bytes_per_token(element_size)


@dataclass(frozen=True)
class CrossAttentionSpec:
    """K and V of the encoder's output, up to `max_encoder_len` positions: written once when the request is
    admitted, never by the decoder's tokens, so its blocks are not found by token hashes."""

    num_kv_heads: int
    head_size: int
    max_encoder_len: int

    kind: ClassVar[str] = "cross_attention"
    follows_tokens: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_positive(self, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                        max_encoder_len=self.max_encoder_len)

    def bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_kv_heads * self.head_size * element_size

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return block_size * self.bytes_per_token(element_size)

    def num_blocks_per_request(self, block_size: int) -> int:
        return -(-self.max_encoder_len // block_size)


@dataclass(frozen=True)
class NoKVCacheSpec:
    """A layer that caches nothing; it belongs to no group."""

    kind: ClassVar[str] = "none"
    follows_tokens: ClassVar[bool] = False

    def bytes_per_token(self, element_size: int) -> int:
        return 0

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return 0


KVCacheSpec = (FullAttentionSpec | SlidingWindowSpec | SinkWindowSpec | LatentAttentionSpec | CrossAttentionSpec
               | NoKVCacheSpec)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with one spec: they share a block table. `layer_indices` count among the model's attention layers
    (every pipeline stage's, in order)."""

    spec: KVCacheSpec
    layer_indices: tuple[int, ...]

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return len(self.layer_indices) * self.spec.bytes_per_block(block_size, element_size)


def group_layers(specs: Sequence[KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Group attention layers by equal spec, groups in the order of their first layer; layers that cache nothing
    join no group. A model whose layers share one spec has exactly one group."""
    members: dict[KVCacheSpec, list[int]] = {}
    for index, spec in enumerate(specs):
        if isinstance(spec, NoKVCacheSpec):
            continue
        members.setdefault(spec, []).append(index)
    return tuple(KVCacheGroup(spec, tuple(indices)) for spec, indices in members.items())


def layer_group_indices(groups: Sequence[KVCacheGroup], num_layers: int) -> list[int | None]:
    """For each of `num_layers` attention layers, the index of its group (None: it caches nothing)."""
    index: list[int | None] = [None] * num_layers
    for g, group in enumerate(groups):
        for layer in group.layer_indices:
            index[layer] = g
    return index


@dataclass(frozen=True)
class KVCacheLayout:
    """The KV cache as the engine sees it: `num_blocks[g]` blocks of `block_size` tokens for group g.

    `keep_all_blocks`: sliding-window groups that keep every block of a request instead of giving back those
    outside the window (a worker-side draft proposer keeps its K/V in group 0's blocks, and its layers may read
    further back)."""

    block_size: int
    groups: tuple[KVCacheGroup, ...]
    num_blocks: tuple[int, ...]
    keep_all_blocks: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache layout needs at least one group")
        if len(self.num_blocks) != len(self.groups):
            raise ValueError(f"{len(self.num_blocks)} block counts for {len(self.groups)} groups")
        if any(n < 1 for n in self.num_blocks):
            raise ValueError(f"every group needs at least one block, got num_blocks={list(self.num_blocks)}")

    @classmethod
    def single_group(cls, num_blocks: int, block_size: int,
                     spec: KVCacheSpec | None = None) -> KVCacheLayout:
        """One group of `num_blocks` blocks: every layer of a model with one spec (full attention unless given;
        the engine only reads a spec's kind, window and encoder length)."""
        group = KVCacheGroup(spec or FullAttentionSpec(num_kv_heads=1, head_size=1), ())
        return cls(block_size, (group,), (num_blocks,))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def min_num_blocks(self) -> int:
        return min(self.num_blocks)

    def check_holds(self, max_model_len: int) -> None:
        """Every group can hold one sequence of max_model_len tokens (cross-attention: one request's encoder
        output); else a ConfigError naming the fix."""
        size = self.block_size
        for group, blocks in zip(self.groups, self.num_blocks):
            spec = group.spec
            if isinstance(spec, CrossAttentionSpec):
                need = spec.num_blocks_per_request(size)
                if blocks < need:
                    raise ConfigError(
                        f"invalid kv_cache_blocks={blocks}: the cross-attention group needs {need} blocks of {size} "
                        f"tokens for max_encoder_len={spec.max_encoder_len}; give more blocks (or memory)")
            elif isinstance(spec, SinkWindowSpec):
                need = spec.max_blocks_per_request(size)
                if blocks < need:
                    raise ConfigError(
                        f"invalid kv_cache_blocks={blocks}: one stream with sink_tokens={spec.sink_tokens} and "
                        f"window={spec.window} holds up to {need} blocks of {size} tokens; give more blocks (or "
                        "memory) or a smaller streaming_window.window")
            elif blocks * size < max_model_len:
                raise ConfigError(
                    f"invalid kv_cache_blocks={blocks}: {blocks} blocks of {size} tokens hold {blocks * size} "
                    f"tokens, fewer than max_model_len={max_model_len}; give more blocks (or memory) or lower "
                    f"max_model_len to <= {blocks * size}")


def as_layout(kv_cache: KVCacheLayout | int, block_size: int) -> KVCacheLayout:
    """A layout as given, or one full-attention group of `kv_cache` blocks (runners that report only a count)."""
    if isinstance(kv_cache, KVCacheLayout):
        if kv_cache.block_size != block_size:
            raise ConfigError(f"the KV cache layout has block_size={kv_cache.block_size} but the engine was "
                              f"configured with block_size={block_size}")
        return kv_cache
    return KVCacheLayout.single_group(kv_cache, block_size)
