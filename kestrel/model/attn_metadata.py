"""AttentionMetadata: the per-step description of a flat batch, passed explicitly to forward()."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """A flat batch of `num_tokens` query tokens from `num_seqs` sequences.

    Sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]`; its context after this
    step is `seq_lens[s]` tokens, the last of which are its query rows (causal masking follows).
    Its KV lives in the blocks `block_tables[s]`; token t is written to slot `slot_mapping[t]`
    (`block_id * block_size + offset`, -1 writes nothing, used for padded rows).
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
