"""CUDA graphs of prefill and mixed (prefill + decode) steps: one graph per (token bucket T, row bucket R).

A step whose rows are not all one-token decodes (those have the decode graphs, `cuda_graph`) and whose N tokens fit
the largest token bucket runs in the graph of the smallest T >= N and the smallest R holding its n rows plus, when
N < T, one pad row. The layout keeps the step's own token order, so the real hidden states are the graph output's
first N rows (no gather):

- tokens 0..N-1 and rows 0..n-1 are the step's, with its own query starts, seq_lens, slots and block tables;
- the pad row n owns the pad tokens N..T-1 (ids 0, positions 0, slot -1: their K/V go nowhere) with seq_len
  T - N and an all-zero block-table row: a self-consistent causal layout that reads block 0 and writes nothing;
  its outputs are dropped;
- rows n+1..R-1 own zero tokens (their query start is T; seq_len 1, block-table row zero): every attention
  program of theirs exits at once.

Every query token belongs to a row (the last query start is T), as in an eager step. What the graph bakes in is
shape-only: T and R size every tensor, the attention's launch choice comes from max_query_len = T (a bound on
every row's query length) and its split count from R (max_seq_len stays 0). Everything else in the forward is
per token (norms, RoPE + KV write, GEMMs, the per-token or static activation quantizers), so padding cannot change
a real token's result beyond the GEMMs' own M-dependent summation order on the GPU.

What runs eagerly instead: steps of more than the largest bucket's tokens or more rows than the largest row
bucket holds, decode-only steps no decode graph holds, steps that write media rows into the input embeddings
(multimodal encoder output), and every step of a runner without graphs (M-RoPE models, tensor/pipeline parallelism,
sink + window attention, enforce_eager). Buckets and `PrefillBuffers` are device-independent (tested on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kestrel.config import PREFILL_GRAPH_TOKEN_RANGE
from kestrel.model.attn_metadata import AttentionMetadata, GroupTables
from kestrel.worker.input_batch import ModelInputs

# Token buckets double from the range's low end up to the configured limit (max_prefill_graph_tokens): a 128-token
# prompt pads to 128, a 129-token one to 256.
MIN_PREFILL_GRAPH_TOKENS, MAX_PREFILL_GRAPH_TOKENS = PREFILL_GRAPH_TOKEN_RANGE
# Row buckets: only the attention grids and the small per-row inputs depend on R (the GEMMs see T tokens), so
# spare rows cost almost nothing and three buckets keep the graph count (and start-up capture time) small.
PREFILL_ROW_BUCKETS = (2, 8, 32)


def is_valid_prefill_limit(limit: int) -> bool:
    """0 (off) or a power of two from MIN_PREFILL_GRAPH_TOKENS to MAX_PREFILL_GRAPH_TOKENS."""
    return limit == 0 or (MIN_PREFILL_GRAPH_TOKENS <= limit <= MAX_PREFILL_GRAPH_TOKENS and limit & (limit - 1) == 0)


@dataclass(frozen=True)
class PrefillBuckets:
    """The token and row buckets captured: every (T, R) with R <= T."""

    tokens: tuple[int, ...]
    rows: tuple[int, ...]

    @classmethod
    def for_engine(cls, limit: int, max_num_batched_tokens: int, max_num_seqs: int) -> PrefillBuckets | None:
        """Token buckets 16, 32, ... up to `limit` (none past the first that holds a whole step's token budget);
        row buckets of PREFILL_ROW_BUCKETS up to the first that holds max_num_seqs rows and the pad row. None when
        `limit` is 0 (off)."""
        if not is_valid_prefill_limit(limit):
            raise ValueError(f"prefill graph limit {limit} must be 0 or a power of two in "
                             f"[{MIN_PREFILL_GRAPH_TOKENS}, {MAX_PREFILL_GRAPH_TOKENS}]")
        if limit == 0:
            return None
        return cls(_doubling_up_to(MIN_PREFILL_GRAPH_TOKENS, limit, max_num_batched_tokens),
                   _first_holding(PREFILL_ROW_BUCKETS, max_num_seqs + 1))

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    def graph_shapes(self) -> list[tuple[int, int]]:
        """Every captured (T, R): each token bucket with the row buckets not above it."""
        return [(t, r) for t in self.tokens for r in self.rows if r <= t]

    def key_for(self, num_scheduled: Sequence[int]) -> tuple[int, int] | None:
        """The (T, R) graph of a step with these per-row token counts, or None when it runs otherwise: a
        decode-only step (decode graphs or eager), or one too large for every bucket."""
        if not num_scheduled or max(num_scheduled) <= 1:
            return None
        num_tokens = sum(num_scheduled)
        tokens = next((t for t in self.tokens if t >= num_tokens), None)
        if tokens is None:
            return None
        rows_needed = len(num_scheduled) + (1 if num_tokens < tokens else 0)
        rows = next((r for r in self.rows if r >= rows_needed), None)
        return None if rows is None or rows > tokens else (tokens, rows)


def _doubling_up_to(first: int, limit: int, enough: int) -> tuple[int, ...]:
    sizes = [first]
    while sizes[-1] < limit and sizes[-1] < enough:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def _first_holding(buckets: Sequence[int], needed: int) -> tuple[int, ...]:
    kept = []
    for size in buckets:
        kept.append(size)
        if size >= needed:
            break
    return tuple(kept)


class StepBuffers:
    """The static per-token and per-row inputs every kind of CUDA graph reads (prefixes of them): token ids,
    positions and slots for `max_tokens` tokens, seq_lens and block-table rows for `max_rows` rows, and the slots
    and block tables of KV-cache groups 1.. (`AttentionMetadata.other_groups`). Padding is id 0, position 0,
    slot -1 for a token and seq_len 1 with a zero block-table row for a row."""

    def __init__(self, max_tokens: int, max_rows: int, block_table_width: int, device: torch.device,
                 num_groups: int = 1) -> None:
        self.device = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_rows, block_table_width, dtype=torch.int32, device=device)
        self.other_groups = [GroupTables(torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
                                         torch.zeros(max_rows, block_table_width, dtype=torch.int32, device=device))
                             for _ in range(num_groups - 1)]

    def _pad_tokens(self, start: int, end: int) -> None:
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(-1)
        for buffers in self.other_groups:
            buffers.slot_mapping[start:end].fill_(-1)

    def _pad_rows(self, start: int, end: int) -> None:
        self.seq_lens[start:end].fill_(1)
        self.block_tables[start:end].zero_()
        for buffers in self.other_groups:
            buffers.block_tables[start:end].zero_()


class PrefillBuffers(StepBuffers):
    """Static inputs of the prefill graphs: tokens for the largest T, rows for the largest R; a graph reads
    prefixes. Tokens and rows past what the latest step loaded hold padding (id 0, position 0, slot -1; seq_len 1,
    a zero block-table row), so a step resets only what an earlier, larger one left."""

    def __init__(self, buckets: PrefillBuckets, block_table_width: int, device: torch.device,
                 num_groups: int = 1) -> None:
        """`block_table_width`: columns per row, at least the widest step's and enough blocks for the pad row's
        seq_len (up to the largest T)."""
        super().__init__(buckets.max_tokens, buckets.max_rows, block_table_width, device, num_groups)
        self.buckets = buckets
        self.block_table_width = block_table_width
        self.query_start_loc = torch.zeros(buckets.max_rows + 1, dtype=torch.int32, device=device)
        self.num_loaded_tokens = 0
        self.num_loaded_rows = 0  # rows holding step data or the pad row

    def metadata(self, tokens: int, rows: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            max_query_len=tokens,
            max_seq_len=0,
            other_groups=tuple(GroupTables(g.slot_mapping[:tokens], g.block_tables[:rows]) for g in self.other_groups),
        )

    def load(self, inputs: ModelInputs, tokens: int, rows: int) -> None:
        """Copy one step (N <= tokens, n rows with n + 1 <= rows when N < tokens) in, padded as the module
        docstring says."""
        meta = inputs.attn_metadata
        num_tokens, n = inputs.input_ids.shape[0], meta.seq_lens.shape[0]
        width = meta.block_tables.shape[1]
        pad_tokens = tokens - num_tokens
        used_rows = n + (1 if pad_tokens else 0)
        if pad_tokens < 0 or used_rows > rows or tokens > self.buckets.max_tokens or rows > self.buckets.max_rows:
            raise ValueError(f"a step of {num_tokens} tokens in {n} rows does not fit the prefill graph of {tokens} "
                             f"tokens and {rows} rows (largest {self.buckets.max_tokens} tokens, "
                             f"{self.buckets.max_rows} rows)")
        if width > self.block_table_width:
            raise ValueError(f"block table of {width} blocks exceeds the prefill graphs' {self.block_table_width}")
        if len(meta.other_groups) < len(self.other_groups):
            raise ValueError(f"a step of {meta.num_groups} KV-cache group(s) for graphs of "
                             f"{1 + len(self.other_groups)}")
        self.input_ids[:num_tokens].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping, non_blocking=True)
        for buffers, step in zip(self.other_groups, meta.other_groups):
            buffers.slot_mapping[:num_tokens].copy_(step.slot_mapping, non_blocking=True)
        if self.num_loaded_tokens > num_tokens:
            self._pad_tokens(num_tokens, self.num_loaded_tokens)
        self.num_loaded_tokens = num_tokens

        self.query_start_loc[: n + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past `width` keep stale block ids: a row's attention never reads past its own seq_len.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        for buffers, step in zip(self.other_groups, meta.other_groups):
            buffers.block_tables[:n, :width].copy_(step.block_tables, non_blocking=True)
        if self.num_loaded_rows > n:
            self._pad_rows(n, self.num_loaded_rows)
        if rows > n:
            self.query_start_loc[n + 1: rows + 1].fill_(tokens)
        if pad_tokens:
            self.seq_lens[n: n + 1].fill_(pad_tokens)
        self.num_loaded_rows = used_rows

    def reset_padding(self) -> None:
        """Every token and row padding, every row empty: the state before the graphs are captured."""
        self._pad_tokens(0, self.buckets.max_tokens)
        self._pad_rows(0, self.buckets.max_rows)
        self.query_start_loc.zero_()
        self.num_loaded_tokens = self.num_loaded_rows = 0

    def load_padding(self, tokens: int, rows: int) -> None:
        """The graph of `tokens` x `rows` captured over a step of padding alone: row 0 is the pad row holding all
        `tokens`, as `load` pads a real step. Every token then belongs to a row, so attention writes each one and
        what the capture-time run feeds on (MoE routing indexes experts by it) is defined, not stale memory."""
        self.query_start_loc[0].zero_()
        self.query_start_loc[1: rows + 1].fill_(tokens)
        self.seq_lens[:1].fill_(tokens)
        self.num_loaded_rows = max(self.num_loaded_rows, 1)
