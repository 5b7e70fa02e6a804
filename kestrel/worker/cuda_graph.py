"""CUDA graphs of decode and verify steps: one graph per (query length, batch bucket), replayed on static buffers.

A decode step (every row has one query token) is padded up to the smallest captured batch bucket that holds it;
graphs may be captured one at a time while the engine serves (`begin_capture`, `capture_next`), the largest
first, and a step no captured graph holds runs eagerly. A verify
step (speculative decoding: a row scores its last token and its k drafts, k + 1 query tokens) runs in the graph
of query length q = the step's longest row, captured for q = 2 .. k + 1 and small batches only (speculation is
turned off for large ones). Every row of such a graph has exactly q query tokens: a shorter row (fewer drafts, a
plain decode row, a short prefill chunk) is padded at its front. Front padding keeps the row's seq_len as it is,
so the attention kernel places each real query token at its true position (seq_len - q + i); the pad tokens sit
at earlier positions, read only keys the row already owns (or none), write their K/V nowhere (slot -1), and
their outputs are dropped by a gather back to the step's own token order.

Padded rows (past the step's batch) have seq_len 1, an all-zero block-table row and slot -1 for every token.
What a graph bakes in is shape-only: the attention's launch choice from max_query_len = q (it bounds every row's
query length, exactly) and its split count from the batch size (max_seq_len stays 0: the split rule must not
see one step's context length).

The buckets and `GraphBuffers` are device-independent (tested on CPU); only `GraphRunner`'s capture and `_replay`
need CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from kestrel.model.attn_metadata import AttentionMetadata, GroupTables
from kestrel.worker.input_batch import ModelInputs, host_tensor
from kestrel.worker.prefill_graph import PrefillBuckets, PrefillBuffers, StepBuffers

logger = logging.getLogger(__name__)

# vLLM's spacing: fine steps where small batches dominate latency, coarser ones above.
_FINE_STEP, _COARSE_STEP, _COARSE_FROM = 8, 16, 256
# Larger decode batches run eagerly: their launch overhead is small next to their GEMMs, and each extra bucket
# costs capture time at startup (vLLM stops at 512 too).
MAX_CAPTURE_BATCH = 512
# Verify graphs: speculation pays at small batch; each (q, bucket) pair is one more graph to capture.
DEFAULT_VERIFY_BATCH = 16
MAX_VERIFY_BATCH = 32

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


def verify_batch_limit(max_num_seqs: int, disable_by_batch_size: int | None) -> int:
    """The largest batch a verify graph is captured for: speculation's own batch limit when set (it does not
    run above it), else DEFAULT_VERIFY_BATCH; never above MAX_VERIFY_BATCH or max_num_seqs."""
    return max(1, min(max_num_seqs, disable_by_batch_size or DEFAULT_VERIFY_BATCH, MAX_VERIFY_BATCH))


def padded_token_index(num_scheduled: list[int], query_len: int) -> list[int] | None:
    """Where each real token of a step sits in the padded layout (row r owns tokens r*q .. r*q + q - 1, its real
    tokens last), in the step's own token order; None when every row already has q tokens (no padding)."""
    if all(count == query_len for count in num_scheduled):
        return None
    index: list[int] = []
    for row, count in enumerate(num_scheduled):
        end = (row + 1) * query_len
        index.extend(range(end - count, end))
    return index


class GraphBuffers(StepBuffers):
    """Static inputs of every graph: token buffers for the largest (bucket x q) and row buffers for the largest
    bucket; a graph reads prefixes of them. Tokens and rows past what the latest step loaded are padding."""

    def __init__(self, max_tokens: int, max_batch: int, max_blocks_per_seq: int, query_lens: list[int],
                 device: torch.device, num_groups: int = 1) -> None:
        super().__init__(max_tokens, max_batch, max_blocks_per_seq, device, num_groups)
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        # Every row of a graph has exactly q tokens, so its query starts are a constant 0, q, 2q, ...
        self.query_start_locs = {
            q: torch.arange(0, (max_batch + 1) * q, q, dtype=torch.int32, device=device) for q in query_lens}
        self.num_loaded_tokens = 0  # tokens 0..num_loaded_tokens may hold a step's data; the rest is padding
        self.num_loaded = 0  # the same for rows

    def metadata(self, bucket: int, query_len: int = 1) -> AttentionMetadata:
        num_tokens = bucket * query_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_locs[query_len][: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=query_len,
            max_seq_len=0,
            other_groups=tuple(GroupTables(g.slot_mapping[:num_tokens], g.block_tables[:bucket])
                               for g in self.other_groups),
        )

    def load(self, inputs: ModelInputs, bucket: int, query_len: int = 1,
             num_scheduled: list[int] | None = None) -> torch.Tensor | None:
        """Copy one step (n <= bucket rows, each with at most `query_len` tokens) in, padded as the module
        docstring says. Returns the device index of the real tokens in the padded layout, or None when they are
        its first tokens in order (no row needed padding)."""
        n = inputs.attn_metadata.seq_lens.shape[0]
        meta = inputs.attn_metadata
        width = meta.block_tables.shape[1]
        counts = num_scheduled if num_scheduled is not None else [1] * n
        if n > bucket or bucket > self.max_batch or bucket * query_len > self.max_tokens:
            raise ValueError(f"{n} rows of {query_len} tokens do not fit bucket {bucket} (largest {self.max_batch} "
                             f"rows, {self.max_tokens} tokens)")
        if len(counts) != n or max(counts, default=0) > query_len:
            raise ValueError(f"rows of {counts} tokens do not fit query length {query_len}")
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block table of {width} blocks exceeds max_blocks_per_seq={self.max_blocks_per_seq}")
        if len(meta.other_groups) < len(self.other_groups):
            raise ValueError(f"a step of {meta.num_groups} KV-cache group(s) for graphs of "
                             f"{1 + len(self.other_groups)}")
        num_tokens = n * query_len
        host_index = padded_token_index(counts, query_len)
        index = None
        if host_index is None:
            self.input_ids[:num_tokens].copy_(inputs.input_ids, non_blocking=True)
            self.positions[:num_tokens].copy_(inputs.positions, non_blocking=True)
            self.slot_mapping[:num_tokens].copy_(meta.slot_mapping, non_blocking=True)
            for buffers, step in zip(self.other_groups, meta.other_groups):
                buffers.slot_mapping[:num_tokens].copy_(step.slot_mapping, non_blocking=True)
        else:
            self._pad_tokens(0, num_tokens)
            pin = self.device.type == "cuda"
            index = host_tensor(host_index, torch.int64, pin).to(self.device, non_blocking=True)
            self.input_ids.index_copy_(0, index, inputs.input_ids)
            self.positions.index_copy_(0, index, inputs.positions)
            self.slot_mapping.index_copy_(0, index, meta.slot_mapping)
            for buffers, step in zip(self.other_groups, meta.other_groups):
                buffers.slot_mapping.index_copy_(0, index, step.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past `width` keep stale block ids: a row's attention never reads past its own seq_len.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        for buffers, step in zip(self.other_groups, meta.other_groups):
            buffers.block_tables[:n, :width].copy_(step.block_tables, non_blocking=True)
        # Only what held data in an earlier step needs resetting: the steady state launches no fills.
        if self.num_loaded_tokens > num_tokens:
            self._pad_tokens(num_tokens, self.num_loaded_tokens)
        self.num_loaded_tokens = num_tokens
        if self.num_loaded > n:
            self._pad_rows(n, self.num_loaded)
        self.num_loaded = n
        return index

    def reset_padding(self) -> None:
        """Every token and row padding: the state graphs are captured in."""
        self._pad_tokens(0, self.max_tokens)
        self._pad_rows(0, self.max_batch)
        self.num_loaded_tokens = self.num_loaded = 0


def graph_pool(device: torch.device) -> object:
    if device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    return torch.cuda.graph_pool_handle()


def capture_graph(fn: Callable[[], torch.Tensor], pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `fn` (device work on static buffers) in `pool`; returns the graph and its static output."""
    fn()  # warm up outside the graph: Triton compiles (and caches) each specialization on its first call
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


class GraphRunner:
    """Captures `forward` once per (query length, bucket), the largest first in one memory pool, and replays it:
    decode graphs (q = 1) up to `max_num_seqs` rows, verify graphs (each q of `verify_query_lens`) up to
    `verify_batch` rows, and with `prefill` the prefill / mixed-step graphs of `kestrel.worker.prefill_graph`
    (one per (token bucket, row bucket), their own static inputs, the same pool)."""

    def __init__(self, forward: ModelForward, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 verify_query_lens: Sequence[int] = (), verify_batch: int = DEFAULT_VERIFY_BATCH,
                 num_groups: int = 1, prefill: PrefillBuckets | None = None, block_size: int = 16) -> None:
        """`block_size`: tokens per KV-cache block, which sizes the prefill graphs' block tables (their pad row
        reads up to the largest token bucket's keys)."""
        self.device = device
        self.forward = forward
        self.sizes = capture_sizes(min(max_num_seqs, MAX_CAPTURE_BATCH))
        self.verify_sizes = capture_sizes(min(verify_batch, max_num_seqs)) if verify_query_lens else []
        if any(q < 2 for q in verify_query_lens):
            raise ValueError(f"verify query lengths {list(verify_query_lens)} must be >= 2")
        self.verify_query_lens = sorted(set(verify_query_lens))
        self.keys = [(1, b) for b in self.sizes] + [(q, b) for q in self.verify_query_lens for b in self.verify_sizes]
        max_tokens = max(q * b for q, b in self.keys)
        self.buffers = GraphBuffers(max_tokens, self.sizes[-1], max_blocks_per_seq, [1, *self.verify_query_lens],
                                    device, num_groups)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.prefill = prefill
        self.prefill_keys = prefill.graph_shapes() if prefill is not None else []
        self.prefill_buffers = None if prefill is None else PrefillBuffers(
            prefill, max(max_blocks_per_seq, -(-prefill.max_tokens // block_size)), device, num_groups)
        self.prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.prefill_outputs: dict[tuple[int, int], torch.Tensor] = {}
        # The buckets captured so far by query length, ascending: a step pads to the smallest one that holds it.
        self.captured_sizes: dict[int, list[int]] = {}
        self._pending: deque[tuple[int, bool, tuple[int, int]]] = deque()
        self._pool: object | None = None
        self.finished_at: float | None = None  # perf_counter() when the last queued graph was captured
        self.capture_seconds = 0.0
        self.prefill_capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _jobs(self) -> list[tuple[int, bool, tuple[int, int]]]:
        """Every graph to capture as (tokens, is_prefill, key), the largest token count first."""
        jobs = [(q * b, False, (q, b)) for q, b in self.keys] + [(t, True, (t, r)) for t, r in self.prefill_keys]
        return sorted(jobs, reverse=True)

    def _job_inputs(self, is_prefill: bool, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                          AttentionMetadata]:
        if is_prefill:
            self.prefill_buffers.load_padding(*key)
            return self._prefill_inputs(key)
        return self._inputs(key)

    def capture_forwards(self) -> list[Callable[[], torch.Tensor]]:
        """The forward of every graph `capture` records, on its own inputs, uncaptured (for compiling ahead)."""
        def run(is_prefill: bool, key: tuple[int, int]) -> torch.Tensor:
            return self.forward(*self._job_inputs(is_prefill, key))

        return [lambda p=is_prefill, k=key: run(p, k) for _, is_prefill, key in self._jobs()]

    def capture(self) -> float:
        """Capture every graph, the largest token count first (decode, verify and prefill graphs in one pool);
        returns (and keeps) the wall time it took."""
        self.begin_capture()
        while self.pending:
            self.capture_next()
        return self.capture_seconds

    def begin_capture(self) -> None:
        """Drop every graph and queue them all for `capture_next`, the largest token count first; until its graph
        is captured, `key_for` and `prefill_key_for` pass a step by (it runs eagerly) or pad it to a larger one."""
        self.graphs.clear()
        self.outputs.clear()
        self.prefill_graphs.clear()
        self.prefill_outputs.clear()
        self.captured_sizes.clear()
        self._pool = None
        self._pending = deque(self._jobs())
        self.capture_seconds = self.prefill_capture_seconds = 0.0
        self.finished_at = None

    @property
    def pending(self) -> bool:
        """Whether graphs queued by `begin_capture` are still to be captured."""
        return bool(self._pending)

    def capture_next(self) -> None:
        """Capture the next queued graph. Its inputs are padding alone (every buffer reset first, so what a step
        loaded before writes nothing through the capture-time run); the next step loads its own."""
        began = time.perf_counter()
        _, is_prefill, key = self._pending.popleft()
        self.buffers.reset_padding()
        if self.prefill_buffers is not None:
            self.prefill_buffers.reset_padding()
        ids, pos, meta = self._job_inputs(is_prefill, key)
        graph, out = self._record(lambda: self.forward(ids, pos, meta))
        seconds = time.perf_counter() - began
        self.capture_seconds += seconds
        if is_prefill:
            self.prefill_graphs[key], self.prefill_outputs[key] = graph, out
            self.prefill_capture_seconds += seconds
        else:
            self.graphs[key], self.outputs[key] = graph, out
            bisect.insort(self.captured_sizes.setdefault(key[0], []), key[1])
        if not self._pending:
            self.finished_at = time.perf_counter()
            self._log_captured()

    def _record(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One graph of `fn` in this runner's pool (made on the first capture after `begin_capture`)."""
        if self._pool is None:
            self._pool = graph_pool(self.device)
        return capture_graph(fn, self._pool)

    def _log_captured(self) -> None:
        decode_seconds = self.capture_seconds - self.prefill_capture_seconds
        logger.info("captured %d CUDA graphs (decode batch sizes %s; verify query lengths %s at batch sizes %s) in "
                    "%.2f s", len(self.keys), self.sizes, self.verify_query_lens, self.verify_sizes, decode_seconds)
        if self.prefill is not None:
            logger.info("captured %d prefill CUDA graphs (token buckets %s x row buckets %s) in %.2f s",
                        len(self.prefill_keys), list(self.prefill.tokens), list(self.prefill.rows),
                        self.prefill_capture_seconds)

    def _prefill_inputs(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        assert self.prefill_buffers is not None
        tokens, rows = key
        buffers = self.prefill_buffers
        return buffers.input_ids[:tokens], buffers.positions[:tokens], buffers.metadata(tokens, rows)

    def _inputs(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        q, bucket = key
        n = q * bucket
        return self.buffers.input_ids[:n], self.buffers.positions[:n], self.buffers.metadata(bucket, q)

    def key_for(self, num_scheduled: list[int], block_table_width: int) -> tuple[int, int] | None:
        """The decode or verify graph a step replays in, or None (then maybe a prefill graph: `prefill_key_for`)."""
        if not self.graphs or not num_scheduled or block_table_width > self.buffers.max_blocks_per_seq:
            return None
        q = max(num_scheduled)
        bucket = bucket_for(len(num_scheduled), self.captured_sizes.get(q, []))
        return None if bucket is None else (q, bucket)

    def prefill_key_for(self, num_scheduled: list[int], block_table_width: int) -> tuple[int, int] | None:
        """The (token bucket, row bucket) prefill graph of a step no decode or verify graph takes, or None."""
        if (self.prefill is None or not self.prefill_graphs or self.prefill_buffers is None
                or block_table_width > self.prefill_buffers.block_table_width):
            return None
        key = self.prefill.key_for(num_scheduled)
        return key if key in self.prefill_graphs else None

    def can_run(self, num_scheduled: list[int], block_table_width: int) -> bool:
        return (self.key_for(num_scheduled, block_table_width) is not None
                or self.prefill_key_for(num_scheduled, block_table_width) is not None)

    def run(self, inputs: ModelInputs, num_scheduled: list[int] | None = None,
            load_more: Callable[[torch.Tensor | None, int, int], None] | None = None) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` of one step, in its own token order: a view of (or a gather from)
        the graph's static output, valid until the next replay. `load_more(index, bucket, q)` fills a forward's
        own static inputs before the replay (`index`: as `GraphBuffers.load` returns it); decode and verify graphs
        only (a step needing it never takes a prefill graph)."""
        counts = num_scheduled if num_scheduled is not None else [1] * inputs.input_ids.shape[0]
        width = inputs.attn_metadata.block_tables.shape[1]
        key = self.key_for(counts, width)
        if key is None:
            prefill_key = None if load_more is not None else self.prefill_key_for(counts, width)
            if prefill_key is None:
                raise ValueError(f"no captured graph for a step of {len(counts)} rows of up to {max(counts)} tokens")
            assert self.prefill_buffers is not None
            self.prefill_buffers.load(inputs, *prefill_key)
            self._replay_prefill(prefill_key)
            return self.prefill_outputs[prefill_key][: inputs.input_ids.shape[0]]
        q, bucket = key
        index = self.buffers.load(inputs, bucket, q, counts)
        if load_more is not None:
            load_more(index, bucket, q)
        self._replay(key)
        out = self.outputs[key]
        return out[: len(counts) * q] if index is None else out.index_select(0, index)

    def _replay(self, key: tuple[int, int]) -> None:
        self.graphs[key].replay()

    def _replay_prefill(self, key: tuple[int, int]) -> None:
        self.prefill_graphs[key].replay()
