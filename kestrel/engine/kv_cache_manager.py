"""KVCacheManager: which blocks each request holds, per KV-cache group; prefix-cache lookup and publication
(pure Python).

Each group of the layout (layers with one KV spec, `kestrel.kv_spec`) has its own BlockPool, and a request holds
one block list per group. Groups whose blocks follow the tokens (full attention, sliding window, latent) grow in
lockstep, one block per `block_size` tokens, so their lists always have the same length; a cross-attention group
takes its blocks once, when the request is admitted. Block hashes are per token chunk, so the same chained hashes
publish and find blocks in every token group; a prefix hit counts only the blocks every such group has.

Attention sinks + window (`SinkWindowSpec`, every token group): each step, the blocks after the sink blocks that lie
wholly below the window of the step's first query are freed and dropped from the request's lists, and its computed
count moves down by their tokens (`Request.num_dropped_tokens`), so a stream holds a bounded number of blocks. Such
groups publish nothing to the prefix cache and find nothing in it: a block's KV depends on how far the window had
slid when it was computed (and on a recomputation after preemption), not on its token prefix alone.

A sliding-window group of window W gives back, each step, the blocks that hold no position the step or any later
one reads (every position below `first computed position - W + 1`): the list keeps a placeholder (None) there, so
block j still holds positions j*B .. j*B + B - 1, and the worker, which keeps the old id, never reads it (attention
masks it, or skips it). A prefix hit in such a group needs only the blocks still in the window at the hit's end.
"""

from __future__ import annotations

from kestrel.engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block
from kestrel.kv_spec import CrossAttentionSpec, KVCacheLayout, SinkWindowSpec, SlidingWindowSpec
from kestrel.request import Request

# What `allocate` returns when no group gained a block (the usual decode step).
NO_NEW_BLOCKS: tuple[list[int], ...] = ()
# The id sent for a block given back (outside the window): any valid id does, since it is never read.
PLACEHOLDER_BLOCK_ID = 0


class KVCacheManager:
    def __init__(self, layout: KVCacheLayout, enable_prefix_caching: bool = True) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.streaming = _streaming_spec(layout)
        enable_prefix_caching = enable_prefix_caching and self.streaming is None
        self.enable_prefix_caching = enable_prefix_caching
        self.num_groups = layout.num_groups
        self.pools = [BlockPool(n, enable_caching=enable_prefix_caching and group.spec.follows_tokens)
                      for group, n in zip(layout.groups, layout.num_blocks)]
        self._token_groups = [g for g, group in enumerate(layout.groups) if group.spec.follows_tokens]
        # Cross-attention groups: (group, blocks per request), taken at admission.
        self._once_groups = [(g, group.spec.num_blocks_per_request(self.block_size))
                             for g, group in enumerate(layout.groups) if isinstance(group.spec, CrossAttentionSpec)]
        # The group whose block count stands for every token group's (they grow in lockstep).
        self._lead = self._token_groups[0] if self._token_groups else 0
        # Sliding-window groups that give back blocks outside their window: (group, window).
        self._windows = [(g, group.spec.window) for g, group in enumerate(layout.groups)
                         if isinstance(group.spec, SlidingWindowSpec) and not isinstance(group.spec, SinkWindowSpec)
                         and g not in layout.keep_all_blocks]
        self._blocks: dict[str, list[list[KVBlock | None]]] = {}
        self._num_released: dict[str, list[int]] = {}  # per request, per window group: leading blocks given back
        self._num_published: dict[str, int] = {}  # leading blocks of each request already published
        # Per request, the token count up to which `allocate(request, n)` (no cached prefix, no lookahead) would
        # change nothing and return NO_NEW_BLOCKS: its blocks hold the tokens and no block would fill that the
        # prefix cache has yet to take. The scheduler's decode loop compares against it instead of calling
        # `allocate` for every request and step. Never set where windows give blocks back.
        self.quiet_until: dict[str, int] = {}
        self._tracks_quiet = not self._windows and self.streaming is None
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def pool(self) -> BlockPool:
        """The first group's pool (the only one of a model whose layers share one spec)."""
        return self.pools[0]

    @property
    def usage(self) -> float:
        """The fullest group's share of blocks in use: the one that runs out first."""
        return max(pool.usage for pool in self.pools)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, in every group; only while no block is in use (False: nothing forgotten)."""
        if any(pool.num_free_blocks != pool.num_blocks for pool in self.pools):
            return False
        return all([pool.reset_prefix_cache() for pool in self.pools])

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group."""
        held = self._blocks.get(request_id)
        if held is None:
            return tuple([] for _ in self.pools)
        return tuple([PLACEHOLDER_BLOCK_ID if b is None else b.block_id for b in blocks] for blocks in held)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[list[KVBlock | None]], int]:
        """Per group, the blocks of the request's longest prefix cached in every token group, and the number of
        tokens they hold (a cross-attention group finds none; a sliding-window group has None where a block is
        outside the window at the prefix's end).

        At least one token is always left to compute, so the step that follows has a row to sample.
        """
        hits: list[list[KVBlock | None]] = [[] for _ in self.pools]
        pooling = request.pooling_params
        if (not self.enable_prefix_caching or not self._token_groups
                or request.sampling_params.prompt_logprobs is not None
                or (pooling is not None and pooling.needs_every_token)):
            # Prompt logprobs and mean / first-token pooling need every prompt position computed: a cached
            # prefix has its KV but no hidden states. (Its blocks are still published for later requests.)
            return hits, 0
        hashes = self._update_hashes(request)
        size = self.block_size
        windows = dict(self._windows)
        # At most the blocks before the last token; every group that reads its whole history needs all of them.
        num_hits = min(len(hashes), (request.num_tokens - 1) // size)
        for g in self._token_groups:
            if g in windows:
                continue
            pool, found = self.pools[g], hits[g]
            for block_hash in hashes[:num_hits]:
                block = pool.lookup(block_hash)
                if block is None:
                    break
                found.append(block)
            num_hits = len(found)
        # A window group needs the blocks in its window at the prefix's end: the longest prefix where all have them.
        while num_hits and not all(
                all(self.pools[g].lookup(h) is not None for h in hashes[self._first_in_window(num_hits * size, w):
                                                                        num_hits])
                for g, w in self._windows):
            num_hits -= 1
        for g in self._token_groups:
            if g in windows:
                first = self._first_in_window(num_hits * size, windows[g])
                hits[g] = [None] * first + [self.pools[g].lookup(h) for h in hashes[first:num_hits]]
            else:
                del hits[g][num_hits:]
        return hits, num_hits * size

    def count_prefix_lookup(self, request: Request, num_cached: int) -> None:
        """The prefix-cache counters of an admitted request's lookup: once per request, as vLLM counts them (a
        preempted request's lookups on readmission, and an admission that did not fit this step, are left out)."""
        if request.num_preemptions == 0:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_cached

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: list[list[KVBlock | None]] | None = None,
                 lookahead: int = 0) -> tuple[list[int], ...] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones, plus `lookahead` positions after those
        (a draft proposer's scratch, never published), in every group; None when some group cannot fit them.

        Returns, per group, the ids of the blocks added to the request (cached prefix first, then fresh ones), or
        NO_NEW_BLOCKS when no group gained one. Full blocks are published to the prefix cache right away: their
        KV is written in this very step, before any attention reads it. Sliding-window groups first give back the
        blocks no query of this step or a later one reads.
        """
        request_id = request.request_id
        held = self._blocks.get(request_id)
        if held is not None and self.streaming is not None:
            self._drop_below_window(request, held)
        num_prefix = len(cached_prefix[self._lead]) if cached_prefix else 0
        num_total = request.num_computed_tokens + num_prefix * self.block_size + num_new_tokens
        num_held = len(held[self._lead]) if held is not None else 0
        needed = -(-(num_total + lookahead) // self.block_size) - num_held - num_prefix
        if held is not None and self._windows:
            self._release_outside_windows(request_id, held, request.num_computed_tokens)
        if held is not None and not num_prefix and needed <= 0:  # the usual decode step: the last block has room
            self._publish_full_blocks(request, held, num_total)
            if self._tracks_quiet:
                self._mark_quiet(request_id, held)
            return NO_NEW_BLOCKS
        fresh_counts = [0] * self.num_groups
        for g in self._token_groups:
            fresh_counts[g] = max(needed, 0)
        for g, per_request in self._once_groups:
            if held is None or not held[g]:
                fresh_counts[g] = per_request
        for g, pool in enumerate(self.pools):
            revived = sum(1 for b in cached_prefix[g] if b is not None and b.ref_count == 0) if cached_prefix else 0
            if fresh_counts[g] + revived > pool.num_free_blocks:
                return None
        if held is None:
            held = self._blocks[request_id] = [[] for _ in self.pools]
            if self._windows:  # a window group's prefix has placeholders before its window
                self._num_released[request_id] = [sum(1 for b in cached_prefix[g] if b is None) if cached_prefix
                                                  else 0 for g, _ in self._windows]
        added: list[list[int]] = []
        for g, pool in enumerate(self.pools):
            prefix = cached_prefix[g] if cached_prefix else []
            pool.touch([b for b in prefix if b is not None])
            fresh = pool.allocate(fresh_counts[g])
            held[g].extend(prefix)
            held[g].extend(fresh)
            added.append([PLACEHOLDER_BLOCK_ID if b is None else b.block_id for b in prefix]
                         + [b.block_id for b in fresh])
        self._publish_full_blocks(request, held, num_total)
        if self._tracks_quiet:
            self._mark_quiet(request_id, held)
        return tuple(added)

    def _mark_quiet(self, request_id: str, held: list[list[KVBlock | None]]) -> None:
        quiet = len(held[self._lead]) * self.block_size
        if self.enable_prefix_caching and self._token_groups:
            # The next block to fill is published by the call that reaches its last token.
            quiet = min(quiet, (self._num_published.get(request_id, 0) + 1) * self.block_size - 1)
        self.quiet_until[request_id] = quiet

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first so the tail is evicted first."""
        held = self._blocks.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        self.quiet_until.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)
        if held:
            for pool, blocks in zip(self.pools, held):
                if blocks:
                    pool.free([b for b in reversed(blocks) if b is not None])

    def _drop_below_window(self, request: Request, held: list[list[KVBlock | None]]) -> None:
        """Free and drop, in every group, the blocks after the sink blocks that lie wholly below the window of the
        step's first query; the request's later positions move down by their tokens."""
        spec, size = self.streaming, self.block_size
        assert spec is not None
        sinks = spec.sink_blocks(size)
        window_start = max(spec.sink_tokens, request.num_computed_tokens - spec.window + 1)
        count = min(window_start // size, len(held[self._lead])) - sinks
        if count <= 0:
            return
        for g in self._token_groups:
            blocks = held[g]
            self.pools[g].free([b for b in reversed(blocks[sinks:sinks + count]) if b is not None])
            del blocks[sinks:sinks + count]
        request.num_dropped_tokens += count * size
        request.num_computed_tokens -= count * size

    def _first_in_window(self, position: int, window: int) -> int:
        """The first block a query at `position` (or later) reads under a window of `window` tokens."""
        return max(position - window + 1, 0) // self.block_size

    def _release_outside_windows(self, request_id: str, held: list[list[KVBlock | None]], first: int) -> None:
        """Give back each window group's blocks before the window of position `first`, the step's first query
        (the computed tokens only grow until the request is freed: rejected drafts fall back to the step's own)."""
        released = self._num_released[request_id]
        for w, (g, window) in enumerate(self._windows):
            end = min(self._first_in_window(first, window), len(held[g]))
            if end <= released[w]:
                continue
            blocks = held[g]
            # Back to front, as `free` does: the older block is evicted first.
            self.pools[g].free([b for b in reversed(blocks[released[w]:end]) if b is not None])
            blocks[released[w]:end] = [None] * (end - released[w])
            released[w] = end

    def _publish_full_blocks(self, request: Request, held: list[list[KVBlock]], num_tokens: int) -> None:
        """Publish the blocks that became full since the last call (each step would otherwise walk them all)."""
        if not self.enable_prefix_caching or not self._token_groups:
            return
        start = self._num_published.get(request.request_id, 0)
        full = min(num_tokens // self.block_size, len(held[self._lead]))
        if full <= start:
            return
        hashes = self._update_hashes(request)
        end = min(full, len(hashes))
        for g in self._token_groups:
            pool, blocks = self.pools[g], held[g]
            for i in range(start, end):
                block = blocks[i]
                if block is not None:
                    pool.cache(block, hashes[i])
        self._num_published[request.request_id] = end

    def _update_hashes(self, request: Request) -> list[BlockHash]:
        """Extend the request's chained block hashes (kept on the request across preemptions)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        media = request.media
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            extra = tuple(item.content_hash for item in media if item.overlaps(start, start + size)) if media else ()
            if start == 0 and request.cache_salt is not None:  # the chain from it on differs from every other salt's
                extra = (f"cache_salt:{request.cache_salt}", *extra)
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(tokens[start:start + size]), extra))
        return hashes


def _streaming_spec(layout: KVCacheLayout) -> SinkWindowSpec | None:
    """The sink + window spec when the layout streams: then it is every token group's spec, so the groups drop
    the same blocks at the same steps."""
    specs = {group.spec for group in layout.groups if group.spec.follows_tokens}
    streaming = [spec for spec in specs if isinstance(spec, SinkWindowSpec)]
    if not streaming:
        return None
    if len({(s.sink_tokens, s.window) for s in specs if isinstance(s, SinkWindowSpec)}) != 1 or any(
            not isinstance(s, SinkWindowSpec) for s in specs):
        raise ValueError(f"attention sinks + window must be every token group's spec, with one sink_tokens and "
                         f"window; got {sorted(str(s) for s in specs)}")
    return streaming[0]
