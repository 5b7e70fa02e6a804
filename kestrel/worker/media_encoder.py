"""The encoder step of multimodal requests: before a step's forward, the media items whose placeholder positions the
step computes are encoded (the model's vision tower and projector, one pass per modality for every item of the step
not cached yet) and their rows written into the step's input embeddings.

The encoder cache keeps outputs by the item's content hash, shared across requests and bounded by embedding rows
(least recently used first out; never an item the current step reads). A prefill chunk that ends inside an item's
placeholders reads its rows again from the cache in the next chunk; an item evicted in between is encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from kestrel.request import MediaItem
from kestrel.worker.input_batch import CachedRequestState


class EncoderCache:
    """Encoder outputs `[rows, hidden]` by content hash, least recently used evicted past `max_rows` rows."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.num_rows = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, content_hash: str) -> torch.Tensor | None:
        rows = self._entries.get(content_hash)
        if rows is not None:
            self._entries.move_to_end(content_hash)
        return rows

    def put(self, content_hash: str, rows: torch.Tensor, keep: set[str]) -> None:
        """Add an output, then evict the oldest entries not in `keep` (what the current step reads) while over the
        bound; the step's own items stay even when they alone are over it."""
        self._entries[content_hash] = rows
        self.num_rows += rows.shape[0]
        for old in list(self._entries):
            if self.num_rows <= self.max_rows:
                break
            if old not in keep:
                self.num_rows -= self._entries.pop(old).shape[0]


class MediaEncoder:
    """Runs the model's `embed_multimodal` for a step's media and writes the rows into its input embeddings."""

    def __init__(self, model: Any, cache_rows: int) -> None:
        self.model = model
        self.cache = EncoderCache(cache_rows)
        self.num_encoder_calls = 0  # embed_multimodal passes run
        self.num_items_encoded = 0  # media items encoded (cache misses)

    def input_embeds(self, states: Sequence[CachedRequestState], counts: Sequence[int],
                     input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings with every scheduled placeholder position filled from its item's encoder
        output; None when the step computes no placeholder (the model embeds the ids itself)."""
        # (the step row of the request's first token, its first computed position, one past its last, the item)
        pieces: list[tuple[int, int, int, MediaItem]] = []
        offset = 0
        for state, count in zip(states, counts):
            if state.media:
                start, end = state.num_computed_tokens, state.num_computed_tokens + count
                pieces += [(offset, start, end, item) for item in state.media if item.overlaps(start, end)]
            offset += count
        if not pieces:
            return None
        outputs = self._encode({item.content_hash: item for *_, item in pieces})
        dst: list[int] = []
        src: list[torch.Tensor] = []
        for row, start, end, item in pieces:
            rows = outputs[item.content_hash]
            first = 0  # the item's output row of its current range's first position
            for range_start, length in item.ranges:
                lo, hi = max(range_start, start), min(range_start + length, end)
                if lo < hi:
                    dst.extend(range(row + lo - start, row + hi - start))
                    src.append(rows[first + lo - range_start: first + hi - range_start])
                first += length
        embeds = self.model.embed_input_ids(input_ids)
        index = torch.tensor(dst, dtype=torch.long, device=embeds.device)
        return embeds.index_copy(0, index, torch.cat(src).to(embeds.dtype))

    def write_cross_kv(self, states: Sequence[CachedRequestState]) -> None:
        """An encoder-decoder model: the cross-attention K/V of the step's requests that have none in their blocks
        yet (their first step since they were added, or re-added after preemption), from their one item's encoder
        output (cached by content hash like any other)."""
        pending = [state for state in states if not state.cross_kv_written]
        if not pending:
            return
        for state in pending:
            if len(state.media) != 1:
                raise RuntimeError(f"request {state.req_id}: an encoder-decoder request needs exactly one media "
                                   f"item, got {len(state.media)}")
        outputs = self._encode({state.media[0].content_hash: state.media[0] for state in pending},
                               check_rows=False)
        self.model.write_cross_kv([outputs[state.media[0].content_hash] for state in pending],
                                  [state.block_ids for state in pending])
        for state in pending:
            state.cross_kv_written = True

    def _encode(self, items: dict[str, MediaItem], check_rows: bool = True) -> dict[str, torch.Tensor]:
        """Each item's encoder output, from the cache or from one encoder pass per modality for the rest
        (`check_rows`: each output has a row per placeholder position)."""
        outputs: dict[str, torch.Tensor] = {}
        missing: dict[str, list[MediaItem]] = {}
        for content_hash, item in items.items():
            cached = self.cache.get(content_hash)
            if cached is None:
                missing.setdefault(item.modality, []).append(item)
            else:
                outputs[content_hash] = cached
        keep = set(items)
        for modality, batch in missing.items():
            encoded = self.model.embed_multimodal(modality, [item.data for item in batch])
            self.num_encoder_calls += 1
            self.num_items_encoded += len(batch)
            for item, rows in zip(batch, encoded, strict=True):
                if check_rows and rows.shape[0] != item.num_embeds:
                    raise RuntimeError(f"the {modality} encoder gave {rows.shape[0]} rows for an item with "
                                       f"{item.num_embeds} placeholder positions")
                outputs[item.content_hash] = rows
                self.cache.put(item.content_hash, rows, keep)
        return outputs
