"""BlockPool: the KV cache's blocks, their reference counts, and the prefix cache (pure Python).

A block is free when no request holds it. Free blocks wait in an LRU queue; a free block that
still holds cached KV (it has a hash) can be revived by a prefix-cache hit until it is reused,
at which point its hash is evicted. Requests free their blocks tail first, so the tail of a
sequence (least likely to be shared) is evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple


class BlockHash(NamedTuple):
    """A full block's identity: its parent's hash chained with its own tokens.

    Keeping the token ids makes a lookup exact (equal keys need equal tokens), not just likely.
    """

    value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...] = ()  # the content hashes of the media whose placeholders the block holds


def hash_block(parent: BlockHash | None, token_ids: tuple[int, ...], extra_keys: tuple[str, ...] = ()) -> BlockHash:
    """`extra_keys`: what the tokens do not say about the block's KV, e.g. the content hashes of the images whose
    placeholders it holds (the placeholder ids are the same for every image)."""
    key = (parent.value if parent else None, token_ids, extra_keys) if extra_keys else (
        parent.value if parent else None, token_ids)
    return BlockHash(hash(key), token_ids, extra_keys)


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` fresh blocks from the front of the free queue, evicting their cached KV."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        taken = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference to blocks found in the prefix cache, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (callers pass tails first)."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its hash, unless an identical block is already published."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)
