"""Turn the scheduled requests of one step into the model's flat inputs and AttentionMetadata.

Host time per step is a throughput limit at large batches (every microsecond per request is multiplied by
hundreds of rows), so the inputs leave the host as three tensors: one int64 (ids, positions, slots, logits
rows), one int32 (query starts, sequence lengths) and the block table, gathered from `BlockTable`, a
persistent host copy that changes only when a request gets a new block.

With several KV-cache groups (layers of different specs, `kestrel.kv_spec`) each group has its own block table
and slot mapping (`BlockTables`, a request on the same row of each); the int64 tensor carries every group's
slots and the block table every group's rows, so a step still moves three tensors.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kestrel.model.attn_metadata import AttentionMetadata, GroupTables
from kestrel.pooling_params import PoolingParams
from kestrel.request import MediaItem
from kestrel.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The worker's copy of a request: its tokens (prompt + generated) and where its KV lives."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    generator: torch.Generator | None = None
    block_table_row: int = -1  # this request's row in the runner's BlockTables (every group's)
    # Async scheduling: tokens sampled by launched steps but not yet collected into `token_ids`, and the row
    # of the latest one in the runner's `last_sampled` device tensor.
    num_pending: int = 0
    pending_row: int = -1
    # Speculative decoding: the draft tokens this step verifies, appended to `token_ids` until it is collected.
    drafts: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None  # a pooling request: its sampling row also pools
    # MEAN pooling: the float32 sum of its prompt's hidden states so far; CLS: its first token's hidden state.
    pooled_partial: torch.Tensor | None = None
    # Attention sinks + window: tokens dropped out of the window, which sat after the first `sink_end` positions;
    # positions (and `num_computed_tokens`, `block_ids`) count the cache's tokens, without them.
    num_dropped_tokens: int = 0
    sink_end: int = 0
    media: tuple[MediaItem, ...] = ()  # the prompt's media items (their encoder output fills their positions)
    # Encoder-decoder models: whether this request's cross-attention K/V are in its blocks (its first step).
    cross_kv_written: bool = False
    # M-RoPE models: the prompt's positions [3, prompt length] and the offset of the positions after it
    # (`kestrel.worker.mrope`), computed on the request's first step.
    mrope_prompt: torch.Tensor | None = None
    mrope_offset: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def host_tensor(values: list[int], dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, pin_memory=pin)` for int32 / int64 values, through an array: a list of
    Python ints converts at C speed there (about 20 ns a value on the development machine, against 70 ns)."""
    tensor = (torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype) if values
              else torch.empty(0, dtype=dtype))
    return torch.empty_like(tensor, pin_memory=True).copy_(tensor) if pin else tensor


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


class BlockTable:
    """Host block table `[max_rows, max_blocks_per_seq]` int32, one row per running request."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int) -> None:
        self.table = torch.zeros(max_rows, max(max_blocks_per_seq, 1), dtype=torch.int32)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._lengths = [0] * max_rows

    @property
    def num_rows_in_use(self) -> int:
        return self.table.shape[0] - len(self._free_rows)

    def add(self, block_ids: list[int]) -> int:
        if not self._free_rows:
            raise RuntimeError(f"block table full: {self.table.shape[0]} rows in use; more requests are running "
                               "than max_num_seqs allows")
        row = self._free_rows.pop()
        self._lengths[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self._lengths[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise ValueError(f"request holds {end} blocks, more than max_blocks_per_seq={self.table.shape[1]}")
        if len(block_ids) == 1:
            self.table[row, start] = block_ids[0]
        else:
            self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        self._lengths[row] = end

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def drop(self, row: int, start: int, count: int) -> None:
        """Remove `count` block ids from `start` on, the later ones moving down (a stream's window slid)."""
        end = self._lengths[row]
        self.table[row, start:end - count] = self.table[row, start + count:end].clone()
        self._lengths[row] = end - count

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """`[len(rows), width]`: entries past a row's own blocks are stale, never read by attention."""
        return self.table[:, :width].index_select(0, host_tensor(rows, torch.int64))


class BlockTables:
    """One `BlockTable` per KV-cache group; a request has the same row in each. `follows_tokens[g]`: whether
    group g's blocks hold the sequence's tokens (its layers write each step's K/V by slot), which group 0's do."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, follows_tokens: Sequence[bool] = (True,)) -> None:
        if not follows_tokens or not follows_tokens[0]:
            raise ValueError("the first KV-cache group must hold the sequence's tokens (full, window or latent)")
        self.follows_tokens = tuple(follows_tokens)
        self.groups = [BlockTable(max_rows, max_blocks_per_seq) for _ in self.follows_tokens]

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, group: int) -> BlockTable:
        return self.groups[group]

    @property
    def num_rows_in_use(self) -> int:
        return self.groups[0].num_rows_in_use

    def add(self, block_ids: Sequence[list[int]]) -> int:
        """A new request's row, holding `block_ids[g]` in group g's table."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"{len(block_ids)} block lists for {len(self.groups)} KV-cache groups")
        rows = {table.add(ids) for table, ids in zip(self.groups, block_ids)}
        if len(rows) != 1:
            raise RuntimeError(f"the groups' block tables gave one request the rows {sorted(rows)}")
        return rows.pop()

    def append(self, row: int, new_block_ids: Sequence[list[int]]) -> None:
        for table, ids in zip(self.groups, new_block_ids, strict=True):
            table.append(row, ids)

    def free(self, row: int) -> None:
        for table in self.groups:
            table.free(row)

    def drop(self, row: int, start: int, count: int) -> None:
        for table in self.groups:
            table.drop(row, start, count)


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]: the rows whose next token is sampled
    sampled_rows: list[int]  # for each logits row, the index of its request in the batch


def build_model_inputs(states: list[CachedRequestState], num_scheduled: list[int], block_size: int,
                       device: torch.device, block_tables: BlockTables,
                       last_sampled: torch.Tensor | None = None) -> ModelInputs:
    """Each request contributes its next `num_scheduled` tokens starting at `num_computed_tokens`.

    A position past the request's known tokens (its token is still in flight: async scheduling) is filled
    on the device from `last_sampled`, the sampled ids of the step launched before this one."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled_rows: list[int] = []
    rows: list[int] = []
    fill_dst: list[int] = []  # input rows whose token is taken from last_sampled[fill_src]
    fill_src: list[int] = []
    max_blocks = 0
    num_tokens = 0
    for row, (state, count) in enumerate(zip(states, num_scheduled)):
        start = state.num_computed_tokens
        end = start + count
        tokens = state.token_ids
        known = len(tokens)
        if state.num_dropped_tokens:
            tokens = _CacheTokens(tokens, state.sink_end, state.num_dropped_tokens)
            known -= state.num_dropped_tokens
        blocks = state.block_ids[0]
        if count == 1:  # decode: the common case, kept free of per-token comprehensions
            input_ids.append(tokens[start] if start < known else 0)
            positions.append(start)
            slots.append(blocks[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(tokens[start:end])
            input_ids.extend([0] * (end - max(known, start)) if end > known else ())
            positions.extend(range(start, end))
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        if end > known:
            if end - known != 1 or state.num_pending != 1 or last_sampled is None:
                raise RuntimeError(f"request {state.req_id}: positions {known}..{end} are not computed yet "
                                   f"({state.num_pending} token(s) in flight)")
            fill_dst.append(num_tokens + count - 1)
            fill_src.append(state.pending_row)
        num_tokens += count
        query_start.append(num_tokens)
        seq_lens.append(end)
        if end >= known:
            logits_indices.append(num_tokens - 1)
            sampled_rows.append(row)
        rows.append(state.block_table_row)
        if len(blocks) > max_blocks:
            max_blocks = len(blocks)
    num_groups = len(block_tables)
    other_slots: list[int] = []
    if num_groups > 1:
        other_slots, max_blocks = _other_group_slots(states, num_scheduled, block_size, block_tables, max_blocks)
    pin = device.type == "cuda"
    longs = host_tensor(input_ids + positions + slots + logits_indices + fill_dst + fill_src + other_slots,
                        torch.int64, pin)
    ints = host_tensor(query_start + seq_lens, torch.int32, pin)
    if num_groups == 1:
        table = block_tables[0].gather(rows, max_blocks)
    else:
        table = torch.cat([group.gather(rows, max_blocks) for group in block_tables.groups])
    if pin:
        longs = longs.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        table = table.pin_memory().to(device, non_blocking=True)
    n, b, s = num_tokens, len(states), len(logits_indices)
    f = 3 * n + s
    if fill_dst:
        dst, src = longs[f: f + len(fill_dst)], longs[f + len(fill_dst): f + 2 * len(fill_dst)]
        longs[:n].index_copy_(0, dst, last_sampled.index_select(0, src))
    other_groups: tuple[GroupTables, ...] = ()
    if num_groups > 1:
        o = f + 2 * len(fill_dst)
        other_groups = tuple(GroupTables(longs[o + (g - 1) * n: o + g * n], table[g * b: (g + 1) * b])
                             for g in range(1, num_groups))
        table = table[:b]
    metadata = AttentionMetadata(
        slot_mapping=longs[2 * n: 3 * n],
        query_start_loc=ints[: b + 1],
        seq_lens=ints[b + 1:],
        block_tables=table,
        max_query_len=max(num_scheduled, default=0),
        max_seq_len=max(seq_lens, default=0),
        other_groups=other_groups,
    )
    return ModelInputs(
        input_ids=longs[:n],
        positions=longs[n: 2 * n],
        attn_metadata=metadata,
        logits_indices=longs[3 * n: 3 * n + s],
        sampled_rows=sampled_rows,
    )


class _CacheTokens:
    """A stream's token ids by cache position: past the sink blocks they sit `dropped` ids further on."""

    def __init__(self, token_ids: list[int], sink_end: int, dropped: int) -> None:
        self.token_ids, self.sink_end, self.dropped = token_ids, sink_end, dropped

    def _index(self, position: int) -> int:
        return position if position < self.sink_end else position + self.dropped

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, int):
            return self.token_ids[self._index(key)]
        start, stop = key.start or 0, key.stop
        head = self.token_ids[start:min(stop, self.sink_end)] if start < self.sink_end else []
        return head + self.token_ids[self._index(max(start, self.sink_end)):self._index(stop)]


def _other_group_slots(states: list[CachedRequestState], num_scheduled: list[int], block_size: int,
                       block_tables: BlockTables, max_blocks: int) -> tuple[list[int], int]:
    """The slots of groups 1.. (one run of num_tokens each, in group order) and the widest block list of any
    group. A group whose blocks do not hold the tokens (cross-attention) writes nothing from them (slot -1)."""
    slots: list[int] = []
    num_tokens = sum(num_scheduled)
    for g in range(1, len(block_tables)):
        if not block_tables.follows_tokens[g]:
            slots.extend([-1] * num_tokens)
            for state in states:
                max_blocks = max(max_blocks, len(state.block_ids[g]))
            continue
        for state, count in zip(states, num_scheduled):
            blocks = state.block_ids[g]
            start = state.num_computed_tokens
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + count))
            max_blocks = max(max_blocks, len(blocks))
    return slots, max_blocks
