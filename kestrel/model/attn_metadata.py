"""AttentionMetadata: the per-step description of a flat batch, passed explicitly to forward()."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupTables:
    """Where one KV-cache group's layers write and read this step: token t goes to slot `slot_mapping[t]`,
    sequence s reads the blocks `block_tables[s]`."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]


@dataclass(frozen=True)
class AttentionMetadata:
    """A flat batch of `num_tokens` query tokens from `num_seqs` sequences.

    Sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]`; its context after this
    step is `seq_lens[s]` tokens, the last of which are its query rows (causal masking follows).
    Its KV lives in the blocks `block_tables[s]`; token t is written to slot `slot_mapping[t]`
    (`block_id * block_size + offset`, -1 writes nothing, used for padded rows).

    Those two are KV-cache group 0's (every layer's, in a model whose layers share one spec); group g > 0 has
    its own in `other_groups[g - 1]` (`for_group`).

    `causal_ends` (None: causal everywhere): query token t sees the keys at positions < causal_ends[t] of its
    sequence instead of those up to its own position, a window still counted back from its position. A row of an
    image that attends to itself both ways (Gemma 3) has its image run's end there; every other row its position
    + 1. Set only for steps that compute such an image (eager steps: they write encoder rows).
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    other_groups: tuple[GroupTables, ...] = ()
    causal_ends: torch.Tensor | None = None  # int32 [num_tokens]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_groups(self) -> int:
        return 1 + len(self.other_groups)

    def for_group(self, group: int) -> GroupTables:
        if group == 0:
            return GroupTables(self.slot_mapping, self.block_tables)
        if not 0 < group <= len(self.other_groups):
            raise IndexError(f"KV-cache group {group} of a step with {self.num_groups} group(s)")
        return self.other_groups[group - 1]

    def sharing_group_tables(self, num_groups: int) -> AttentionMetadata:
        """This step with `num_groups` groups that all write and read group 0's slots and blocks: programs of one
        sequence whose block ids are the same in every group (the memory profile, FP8 scale calibration)."""
        if num_groups <= 1:
            return self
        shared = GroupTables(self.slot_mapping, self.block_tables)
        return dataclasses.replace(self, other_groups=(shared,) * (num_groups - 1))
