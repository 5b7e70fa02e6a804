"""The surprisal of every token of a batch of short sequences, from one prefill forward of a runner's model outside
the engine's scheduler: the prompt compressor's scorer (`entrypoints/prompt_compression.py`). Nothing leaves the
device but one float per scored token."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.runner_setup import RunnerSetup
from kestrel.worker.step_sampling import to_device

# Logits scored at once (64 MiB of float32): the scorer runs beside a served model that holds most of the device's
# memory, so its temporaries stay small.
LOGIT_PIECE_ELEMENTS = 1 << 24


@torch.inference_mode()
def token_surprisal(runner: RunnerSetup, sequences: Sequence[Sequence[int]],
                    score_from: Sequence[int]) -> list[list[float]]:
    """-ln p(token | the tokens before it in its sequence), in nats, for positions `score_from[i]` to the end of
    each sequence (`score_from[i]` >= 1). Each sequence starts at position 0 in cache blocks of its own; all of
    them run in one forward, so they must fit the runner's context and cache together."""
    if len(sequences) != len(score_from):
        raise ValueError(f"{len(sequences)} sequences but {len(score_from)} score_from values")
    lengths = [len(s) for s in sequences]
    block = runner.block_size
    blocks = [-(-n // block) for n in lengths]
    context = runner.config.model.max_model_len
    if any(n < 1 for n in lengths) or (context and max(lengths) > context):
        raise ValueError(f"sequence lengths {min(lengths)}-{max(lengths)}: each must hold 1 to {context} tokens")
    if sum(blocks) > runner.num_blocks:
        raise ValueError(f"the sequences need {sum(blocks)} cache blocks, the runner has {runner.num_blocks}")
    if any(not 1 <= s <= n for s, n in zip(score_from, lengths)):
        raise ValueError("score_from must lie in [1, len(sequence)] for each sequence")
    first_block = [0, *itertools.accumulate(blocks)]
    starts = [0, *itertools.accumulate(lengths)]
    slots = torch.cat([torch.arange(n) + b * block for n, b in zip(lengths, first_block)])
    table = torch.zeros(len(sequences), max(blocks), dtype=torch.int32)
    for i, (b, count) in enumerate(zip(first_block, blocks)):
        table[i, :count] = torch.arange(b, b + count, dtype=torch.int32)
    device = runner.device
    meta = AttentionMetadata(
        slot_mapping=to_device(slots, device),
        query_start_loc=to_device(torch.tensor(starts, dtype=torch.int32), device),
        seq_lens=to_device(torch.tensor(lengths, dtype=torch.int32), device),
        block_tables=to_device(table, device),
        max_query_len=max(lengths), max_seq_len=max(lengths),
    ).sharing_group_tables(len(runner.kv_groups))
    ids = to_device(torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long), device)
    positions = to_device(torch.cat([torch.arange(n) for n in lengths]), device)
    hidden = runner._run_model(ids, positions, meta)
    # row p predicts token p + 1 of its sequence
    rows = torch.cat([torch.arange(q + s - 1, q + n - 1) for q, s, n in zip(starts, score_from, lengths)])
    targets = to_device(torch.cat([torch.as_tensor(seq[s:], dtype=torch.long)
                                   for seq, s in zip(sequences, score_from)]), device)
    rows = to_device(rows, device)
    out = torch.empty(len(rows), dtype=torch.float32, device=device)
    begin, piece = 0, 1024
    while begin < len(rows):
        end = begin + piece
        logits = runner.model.compute_logits(hidden[rows[begin:end]])
        chosen = logits.gather(1, targets[begin:end, None]).squeeze(1)
        out[begin:end] = torch.logsumexp(logits, dim=-1) - chosen
        begin, piece = end, max(1, LOGIT_PIECE_ELEMENTS // logits.shape[1])
    values = out.tolist()
    scored = [n - s for s, n in zip(score_from, lengths)]
    offsets = [0, *itertools.accumulate(scored)]
    return [values[a:b] for a, b in zip(offsets, offsets[1:])]
