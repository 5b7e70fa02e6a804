"""KVCacheManager: which blocks each request holds, prefix-cache lookup and publication (pure Python)."""

from __future__ import annotations

from kestrel.engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block
from kestrel.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks of each request already published
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[KVBlock], int]:
        """Blocks of the request's longest cached prefix, and the number of tokens they hold.

        At least one token is always left to compute, so the step that follows has a row to sample.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed.
            return [], 0
        hashes = self._update_hashes(request)
        hits: list[KVBlock] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[KVBlock] | None = None,
                 lookahead: int = 0) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones, plus `lookahead` positions after those
        (a draft proposer's scratch, never published); None when they do not fit.

        Returns the ids of the blocks added to the request (cached prefix first, then fresh ones).
        Full blocks are published to the prefix cache right away: their KV is written in this very
        step, before any attention reads it.
        """
        request_id = request.request_id
        held = self._blocks.get(request_id)
        if held is None:
            held = self._blocks[request_id] = []
        num_prefix = len(cached_prefix) if cached_prefix else 0
        num_total = request.num_computed_tokens + num_prefix * self.block_size + num_new_tokens
        needed = -(-(num_total + lookahead) // self.block_size) - len(held) - num_prefix
        if not num_prefix and needed <= 0:  # the usual decode step: the last block still has room
            self._publish_full_blocks(request, held, num_total)
            return []
        cached_prefix = cached_prefix or []
        revived = sum(1 for b in cached_prefix if b.ref_count == 0)
        if max(needed, 0) + revived > self.pool.num_free_blocks:
            if not held:
                del self._blocks[request_id]
            return None
        self.pool.touch(cached_prefix)
        fresh = self.pool.allocate(max(needed, 0))
        held.extend(cached_prefix)
        held.extend(fresh)
        self._publish_full_blocks(request, held, num_total)
        return [b.block_id for b in cached_prefix] + [b.block_id for b in fresh]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so the tail is evicted first."""
        held = self._blocks.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        if held:
            self.pool.free(list(reversed(held)))

    def _publish_full_blocks(self, request: Request, held: list[KVBlock], num_tokens: int) -> None:
        """Publish the blocks that became full since the last call (each step would otherwise walk them all)."""
        if not self.enable_prefix_caching:
            return
        start = self._num_published.get(request.request_id, 0)
        full = min(num_tokens // self.block_size, len(held))
        if full <= start:
            return
        hashes = self._update_hashes(request)
        for i in range(start, min(full, len(hashes))):
            self.pool.cache(held[i], hashes[i])
        self._num_published[request.request_id] = min(full, len(hashes))

    def _update_hashes(self, request: Request) -> list[BlockHash]:
        """Extend the request's chained block hashes (kept on the request across preemptions)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(tokens[start:start + size])))
        return hashes
