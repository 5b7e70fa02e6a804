"""A step's inputs on the worker: the per-request state kept between steps (each scheduler output carries only
deltas), and the scheduled requests -> the model's flat inputs (`input_batch.build_model_inputs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.engine.contracts import NewRequestData, SchedulerOutput
from kestrel.worker.drafter import Drafter
from kestrel.worker.input_batch import BlockTables, CachedRequestState, ModelInputs, build_model_inputs


@dataclass(frozen=True)
class ScheduledStep:
    """The requests a step computes, in batch order, with their token counts and the model inputs."""

    req_ids: list[str]
    states: list[CachedRequestState]
    counts: list[int]
    inputs: ModelInputs


class StepInputs:
    """The worker's copy of every running request (tokens, blocks, block-table row, seeded generator) and the
    sampled ids of the latest launched step on the device, which a step launched before they reach the host reads
    for the positions still in flight."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 drafter: Drafter | None, groups_follow_tokens: list[bool], sink_blocks: int | None = None) -> None:
        """`groups_follow_tokens`: per KV-cache group, whether its blocks follow the request's tokens (one block
        table each). `sink_blocks`: with attention sinks + window, the blocks kept at the start of each request;
        the blocks dropped out of its window are removed after them."""
        self.block_size = block_size
        self.sink_blocks = sink_blocks
        self.device = device
        self.drafter = drafter
        self.requests: dict[str, CachedRequestState] = {}
        # A preempted seeded request's generator, until it runs again: it goes on from where it was, so the
        # request samples what it would have unpreempted (a new one would replay its first draws).
        self.preempted_generators: dict[str, torch.Generator] = {}
        self.block_table = BlockTables(max_num_seqs, max_blocks_per_seq, groups_follow_tokens)
        self.last_sampled: torch.Tensor | None = None  # sampled ids of the latest launched step, on the device

    def apply(self, out: SchedulerOutput) -> None:
        """The scheduler output's deltas: releases first (their rows are free for this step's new requests),
        new requests, new blocks and computed counts, then the drafts this step verifies."""
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.block_table.free(state.block_table_row)
                if req_id in out.preempted_req_ids and state.generator is not None:
                    self.preempted_generators[req_id] = state.generator
            if req_id in out.finished_req_ids:  # finished, or aborted while preempted
                self.preempted_generators.pop(req_id, None)
        for new in out.new_requests:
            self._add(new)
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            if cached.num_dropped_tokens != state.num_dropped_tokens:
                self._drop(state, cached.num_dropped_tokens)
            if cached.new_block_ids:
                for ids, added in zip(state.block_ids, cached.new_block_ids, strict=True):
                    ids.extend(added)
                self.block_table.append(state.block_table_row, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            state = self.requests[req_id]
            state.drafts = list(drafts)
            state.token_ids.extend(drafts)  # the step's inputs; replaced by the accepted tokens on collect

    def _drop(self, state: CachedRequestState, num_dropped_tokens: int) -> None:
        """The blocks the scheduler dropped out of a stream's window since the last step, after its sink blocks."""
        if self.sink_blocks is None:
            raise RuntimeError(f"request {state.req_id}: tokens dropped, but the runner does not stream")
        count = (num_dropped_tokens - state.num_dropped_tokens) // self.block_size
        for ids in state.block_ids:
            del ids[self.sink_blocks:self.sink_blocks + count]
        self.block_table.drop(state.block_table_row, self.sink_blocks, count)
        state.num_dropped_tokens = num_dropped_tokens

    def _add(self, new: NewRequestData) -> None:
        generator = self.preempted_generators.pop(new.req_id, None)
        if generator is None and new.sampling_params.seed is not None:
            generator = torch.Generator(self.device)
            generator.manual_seed(new.sampling_params.seed)
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params,
            block_ids=[list(ids) for ids in new.block_ids],
            num_computed_tokens=new.num_computed_tokens,
            generator=generator,
            block_table_row=self.block_table.add(new.block_ids),
            pooling_params=new.pooling_params,
            num_dropped_tokens=new.num_dropped_tokens,
            sink_end=(self.sink_blocks or 0) * self.block_size,
            media=new.media,
        )
        if self.drafter is not None:
            self.drafter.reset_row(self.requests[new.req_id].block_table_row)

    def prepare(self, out: SchedulerOutput) -> ScheduledStep | None:
        """The scheduled requests' model inputs (after `apply`); None when nothing is scheduled. A position whose
        token is still in flight reads it from `last_sampled` on the device."""
        req_ids = list(out.num_scheduled_tokens)
        if not req_ids:
            return None
        states = [self.requests[rid] for rid in req_ids]
        counts = [out.num_scheduled_tokens[rid] for rid in req_ids]
        inputs = build_model_inputs(states, counts, self.block_size, self.device, self.block_table,
                                    self.last_sampled)
        return ScheduledStep(req_ids, states, counts, inputs)

    @staticmethod
    def mark_computed(step: ScheduledStep) -> None:
        for state, count in zip(step.states, step.counts):
            state.num_computed_tokens += count

    def record_sampled(self, req_ids: list[str], sampled_token_ids: list[list[int]]) -> None:
        """The tokens the last stage added to each request in a step (a pipeline stage before the last); requests
        released meanwhile are skipped."""
        for req_id, tokens in zip(req_ids, sampled_token_ids, strict=True):
            state = self.requests.get(req_id)
            if state is None:
                continue
            if state.drafts:  # a verify step: its drafts were this stage's inputs; the accepted ones come back
                del state.token_ids[len(state.token_ids) - len(state.drafts):]
                state.drafts = []
            state.token_ids.extend(tokens)
