"""Decode CUDA graphs: one graph per batch-size bucket, replayed on static input buffers.

A decode step (every sequence has exactly one query token) is padded up to the smallest bucket that holds it.
Padded rows write their K/V nowhere (slot -1), have seq_len 1 and an all-zero block-table row, so their
attention reads one slot of block 0 and their outputs are discarded. `query_start_loc` of a decode batch is
always `0..B`, so it is a constant buffer.

The bucket list and `DecodeBuffers` are device-independent (tested on CPU); only `DecodeGraphRunner.capture`
and `replay` need CUDA.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.input_batch import ModelInputs

logger = logging.getLogger(__name__)

# vLLM's spacing: fine steps where small batches dominate latency, coarser ones above.
_FINE_STEP, _COARSE_STEP, _COARSE_FROM = 8, 16, 256
# Larger decode batches run eagerly: their launch overhead is small next to their GEMMs, and each extra bucket
# costs capture time at startup (vLLM stops at 512 too).
MAX_CAPTURE_BATCH = 512

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, 16, 24, ..., 256, 272, ...: every size below `max_num_seqs` plus the first one
    at or above it, so any decode batch the scheduler can form has a bucket."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
    sizes: list[int] = []
    size = 1
    while True:
        sizes.append(size)
        if size >= max_num_seqs:
            return sizes
        if size < _FINE_STEP:
            size *= 2
        elif size < _COARSE_FROM:
            size += _FINE_STEP
        else:
            size += _COARSE_STEP


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `batch_size` rows, or None when the batch is larger than every bucket."""
    for size in sizes:
        if size >= batch_size:
            return size
    return None


def is_decode_only(num_scheduled: list[int]) -> bool:
    return bool(num_scheduled) and all(count == 1 for count in num_scheduled)


class DecodeBuffers:
    """Static inputs of the decode graphs, sized for the largest bucket; graphs read prefixes of them."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.num_loaded = 0  # rows 0..num_loaded hold a step's data; every row after them is padding

    def metadata(self, bucket: int) -> AttentionMetadata:
        # max_seq_len only tunes the attention's split count, which a graph must not bake in from one step.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=0,
        )

    def load(self, inputs: ModelInputs, bucket: int) -> None:
        """Copy one decode step (n <= bucket rows) in; rows n..bucket are left (or reset to) harmless padding."""
        n = inputs.input_ids.shape[0]
        meta = inputs.attn_metadata
        width = meta.block_tables.shape[1]
        if n > bucket or bucket > self.max_batch:
            raise ValueError(f"{n} rows do not fit bucket {bucket} (largest {self.max_batch})")
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block table of {width} blocks exceeds max_blocks_per_seq={self.max_blocks_per_seq}")
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past `width` keep stale block ids: a row's attention never reads past its own seq_len.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        # Only rows that held data in an earlier step need resetting: the steady state launches no fills.
        if self.num_loaded > n:
            self._pad(n, self.num_loaded)
        self.num_loaded = n

    def _pad(self, start: int, end: int) -> None:
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(-1)
        self.seq_lens[start:end].fill_(1)
        self.block_tables[start:end].zero_()

    def reset_padding(self) -> None:
        """Every row padding: the state graphs are captured in."""
        self._pad(0, self.max_batch)
        self.num_loaded = 0


class DecodeGraphRunner:
    """Captures `forward` once per bucket (largest first, one memory pool) and replays it for decode steps."""

    def __init__(self, forward: ModelForward, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.device = device
        self.forward = forward
        self.sizes = capture_sizes(min(max_num_seqs, MAX_CAPTURE_BATCH))
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks_per_seq, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def capture(self) -> float:
        """Capture every bucket; returns (and keeps) the wall time it took."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        start = time.perf_counter()
        self.graphs.clear()
        self.outputs.clear()
        self.buffers.reset_padding()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):
            ids, pos = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
            meta = self.buffers.metadata(bucket)
            # Warm up outside the graph: Triton compiles (and caches) each specialization on its first call.
            self.forward(ids, pos, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.forward(ids, pos, meta)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.2f s", len(self.sizes),
                    self.sizes, self.capture_seconds)
        return self.capture_seconds

    def can_run(self, num_scheduled: list[int], block_table_width: int) -> bool:
        return (bool(self.graphs) and is_decode_only(num_scheduled) and len(num_scheduled) <= self.max_batch
                and block_table_width <= self.buffers.max_blocks_per_seq)

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states `[n, hidden]` of one decode step: a view of the bucket's static output, valid until
        the next replay."""
        n = inputs.input_ids.shape[0]
        bucket = bucket_for(n, self.sizes)
        if bucket is None:
            raise ValueError(f"decode batch of {n} exceeds the largest captured bucket {self.max_batch}")
        self.buffers.load(inputs, bucket)
        self._replay(bucket)
        return self.outputs[bucket][:n]

    def _replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()
