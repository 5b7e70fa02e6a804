"""M-RoPE positions for models that rotate by three position rows (Qwen2-VL): the step's `[3, T]` positions in place
of the flat `[T]` ones. The model computes each request's prompt rows once (`mrope_positions`, from its media); a
position past the prompt is the flat one plus the request's offset in all three rows (what the prompt's images
saved or added), so decode steps continue where the prompt's positions left off."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kestrel.worker.step_inputs import ScheduledStep


def uses_mrope(model: Any) -> bool:
    return callable(getattr(model, "mrope_positions", None))


def with_mrope_positions(model: Any, step: ScheduledStep) -> ScheduledStep:
    rows: list[torch.Tensor] = []
    for state, count in zip(step.states, step.counts):
        if state.mrope_prompt is None:
            state.mrope_prompt, state.mrope_offset = model.mrope_positions(state.prompt_token_ids, state.media)
        prompt = state.mrope_prompt
        start, end = state.num_computed_tokens, state.num_computed_tokens + count
        if start < prompt.shape[1]:
            rows.append(prompt[:, start:min(end, prompt.shape[1])])
        if end > prompt.shape[1]:
            rows.append(torch.arange(max(start, prompt.shape[1]), end).expand(3, -1) + state.mrope_offset)
    positions = torch.cat(rows, dim=1).to(step.inputs.positions.device)
    return dataclasses.replace(step, inputs=dataclasses.replace(step.inputs, positions=positions))
