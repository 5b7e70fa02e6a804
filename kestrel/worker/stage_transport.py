"""One forward of this rank's part of the model, with pipeline transport: a stage after the first receives the
previous stage's intermediate tensors, a stage before the last sends its own. Models never send or receive."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.distributed.parallel import ParallelContext
from kestrel.model.attn_metadata import AttentionMetadata


def run_model(model: nn.Module, parallel: ParallelContext | None, input_ids: torch.Tensor, positions: torch.Tensor,
              attn_metadata: AttentionMetadata, *, transport: bool = True,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The last stage's hidden states `[T, hidden]`; an earlier stage returns its outgoing hidden states, which
    nothing reads. `transport=False` (memory profiling) feeds a later stage zeros instead of receiving.
    `inputs_embeds`: the first stage's input embeddings with the media's rows written in (multimodal steps)."""
    intermediate = None
    if parallel is not None and not parallel.is_first_stage:
        specs = model.intermediate_specs(input_ids.shape[0])
        if transport:
            received = parallel.recv_from_prev_stage(list(specs.values()), input_ids.device)
        else:
            received = [torch.zeros(shape, dtype=dtype, device=input_ids.device) for shape, dtype in specs.values()]
        intermediate = dict(zip(specs, received, strict=True))
    if inputs_embeds is None:
        out = model(input_ids, positions, attn_metadata, intermediate)
    else:
        out = model(input_ids, positions, attn_metadata, intermediate, inputs_embeds=inputs_embeds)
    if isinstance(out, dict):
        if transport:
            parallel.send_to_next_stage(list(out.values()))
        return out["hidden_states"]
    return out
