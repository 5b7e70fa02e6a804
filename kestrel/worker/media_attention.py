"""Causal ends for models whose images attend to themselves both ways (Gemma 3): a step that computes an image's
placeholder run gets `AttentionMetadata.causal_ends`, each of the run's rows seeing keys up to the run's end and every
other row up to itself. The scheduler computes a run within one step (`kestrel.request.end_outside_runs`), so the
keys a row may see are all written by the time the step attends; prefix-cached rows of a run were computed the same
way (the run's image is in their blocks' hashes)."""

from __future__ import annotations

import dataclasses

import torch

from kestrel.worker.input_batch import CachedRequestState
from kestrel.worker.step_inputs import ScheduledStep


def _runs_in_step(state: CachedRequestState, start: int, end: int) -> list[tuple[int, int]]:
    """The bidirectional runs (start, end) whose positions the step computes for this request."""
    runs = []
    for item in state.media:
        if not item.bidirectional:
            continue
        for run_start, length in item.ranges:
            run_end = run_start + length
            if run_start < end and start < run_end:
                if run_end > end:
                    raise RuntimeError(f"request {state.req_id}: a step computing positions {start}..{end} cuts the "
                                       f"image run {run_start}..{run_end}, which attends to itself both ways")
                runs.append((max(run_start, start), run_end))
    return runs


def with_causal_ends(step: ScheduledStep) -> ScheduledStep:
    """The step with its rows' causal ends when it computes a bidirectional image run; else the step as it is."""
    per_request = []
    found = False
    for state, count in zip(step.states, step.counts):
        start = state.num_computed_tokens
        runs = _runs_in_step(state, start, start + count) if state.media else []
        found = found or bool(runs)
        per_request.append((start, count, runs))
    if not found:
        return step
    ends: list[int] = []
    for start, count, runs in per_request:
        row = list(range(start + 1, start + count + 1))
        for lo, run_end in runs:
            row[lo - start: run_end - start] = [run_end] * (run_end - lo)
        ends += row
    device = step.inputs.positions.device
    metadata = dataclasses.replace(step.inputs.attn_metadata,
                                   causal_ends=torch.tensor(ends, dtype=torch.int32).to(device))
    return dataclasses.replace(step, inputs=dataclasses.replace(step.inputs, attn_metadata=metadata))
