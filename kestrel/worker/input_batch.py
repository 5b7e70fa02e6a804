"""Turn the scheduled requests of one step into the model's flat inputs and AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The worker's copy of a request: its tokens (prompt + generated) and where its KV lives."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]: the rows whose next token is sampled
    sampled_rows: list[int]  # for each logits row, the index of its request in the batch


def build_model_inputs(states: list[CachedRequestState], num_scheduled: list[int], block_size: int,
                       device: torch.device) -> ModelInputs:
    """Each request contributes its next `num_scheduled` tokens starting at `num_computed_tokens`."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled_rows: list[int] = []
    for row, (state, count) in enumerate(zip(states, num_scheduled)):
        start = state.num_computed_tokens
        end = start + count
        input_ids.extend(state.token_ids[start:end])
        positions.extend(range(start, end))
        blocks = state.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start.append(query_start[-1] + count)
        seq_lens.append(end)
        if end == len(state.token_ids):
            logits_indices.append(query_start[-1] - 1)
            sampled_rows.append(row)
    max_blocks = max((len(s.block_ids) for s in states), default=0)
    block_table = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in states]
    pin = device.type == "cuda"

    def to_device(values, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype, pin_memory=pin)
        return tensor.to(device, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64),
        query_start_loc=to_device(query_start, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        block_tables=to_device(block_table, torch.int32).reshape(len(states), max_blocks),
        max_query_len=max(num_scheduled, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return ModelInputs(
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        attn_metadata=metadata,
        logits_indices=to_device(logits_indices, torch.int64),
        sampled_rows=sampled_rows,
    )
