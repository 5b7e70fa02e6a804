"""The only types that cross between the engine (scheduler) and a worker (model runner).

A worker keeps its own per-request state, so each step carries new requests in full and
running ones as deltas (new block ids, a computed count set back), only for those with one: a decode step of
requests whose last block has room carries nothing per request but its token count. A request resumed after
preemption is sent again as new.
Block ids come one list per KV-cache group, in the order of the worker's `KVCacheLayout.groups`.

A step may carry, per request, draft tokens to verify (speculative decoding) and may constrain the next token
with a grammar bitmask (structured outputs); the worker returns the accepted tokens per request, one or more, and
(with a draft model or an EAGLE head) the drafts it proposes for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from kestrel.outputs import Logprob
from kestrel.pooling_params import PoolingParams
from kestrel.request import MediaItem
from kestrel.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker has not seen (or has dropped after a preemption)."""

    req_id: str
    token_ids: list[int]  # prompt plus any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per KV-cache group
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    pooling_params: PoolingParams | None = None  # a pooling request: the worker returns its pooled hidden state
    # Attention sinks + window: tokens dropped out of the window right after the sink blocks (whole blocks); the
    # computed count and the block lists leave them out.
    num_dropped_tokens: int = 0
    media: tuple[MediaItem, ...] = ()  # the prompt's media items: the worker encodes them and fills their positions


class CachedRequestData(NamedTuple):
    """A request that ran in an earlier step, when more changed than its scheduled tokens: it gained blocks, its
    computed count moved back (drafts rejected), or it streams (attention sinks + window). A scheduled request the
    runner knows without one computes from its own count, which each step advances by the step's tokens. (A named
    tuple: cheap to build.)"""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # per KV-cache group; () when no group gained a block
    num_computed_tokens: int
    # Attention sinks + window: the request's dropped tokens so far; the blocks dropped since the last step are
    # removed from every group's list after the sink blocks, before `new_block_ids` are appended.
    num_dropped_tokens: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    # Tokens to compute this step per request id, in batch order (new requests after cached ones).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must forget: finished, aborted or preempted since the last step.
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()
    # Draft tokens per request, to verify this step: the last len(drafts) of its scheduled tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests whose tokens this step are grammar-constrained: the step's GrammarBitmask has their rows.
    structured_output_request_ids: frozenset[str] = frozenset()
    # Requests the worker's draft proposer (draft model, EAGLE head) proposes for once this step's tokens are
    # known: each samples this step, and its blocks cover `draft_lookahead` positions past the step's tokens (the
    # proposer writes its own K/V there).
    draft_request_ids: frozenset[str] = frozenset()
    draft_lookahead: int = 0

    # The scheduler's number for this step: its tokens are matched to the requests it scheduled, not to a later
    # request that reuses the id of one that ended while the step was in flight.
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing to compute. Such an output may still release requests, and must reach the runner then."""
        return self.total_num_scheduled_tokens == 0

    @property
    def releases_requests(self) -> bool:
        return bool(self.finished_req_ids or self.preempted_req_ids)


@dataclass(frozen=True)
class GrammarBitmask:
    """Allowed next tokens of constrained requests, filled on the host while the forward runs: row i of
    `bitmask` (int32 [rows, ceil(vocab / 32)], bit t % 32 of word t // 32 set = token t allowed) belongs to
    `req_ids[i]`. Opaque to the engine: the structured-output backend builds it, the worker applies it."""

    req_ids: list[str]
    bitmask: Any


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per scheduled request, in the order of `req_ids`: the tokens the step adds, in order (the accepted
    drafts and one sampled token; empty for a partial prefill chunk)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per added token: {token_id: Logprob} for it and the request's top-k, when it asked for logprobs.
    logprobs: list[list[dict[int, Logprob]] | None] = field(default_factory=list)
    # Prompt logprobs computed this step for the request's prompt positions (chunk by chunk).
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    # Draft tokens proposed on the worker for the next step, per request of the step's `draft_request_ids`.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per pooling request whose prompt this step completed: its pooled final hidden state.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # With expert_load_metrics, every expert_load_interval steps: the (token, expert) assignments of each
    # mixture-of-experts layer since start, {layer index: count per expert} (totals, not this step's).
    expert_load: dict[int, list[int]] | None = None


class StepHandle(Protocol):
    """What a verb called with `non_block=True` returns: `result()` waits for the value the blocking call returns."""

    def result(self) -> Any: ...


@dataclass(frozen=True)
class Ready:
    """A handle whose value is known already (a runner that has nothing to wait for)."""

    value: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput | None:
        return self.value


@runtime_checkable
class Runner(Protocol):
    """What the engine needs from a worker: two verbs per step.

    `execute_model(s)` applies the scheduler output (releases, new requests, new blocks) and enqueues the step's
    forward. It returns None when the step samples, and `sample_tokens` must follow; a step with nothing to sample
    may return its output at once (one with nothing to compute, which only releases requests, always does).
    `sample_tokens(g)` samples the step executed last, its constrained rows masked by the grammar bitmask `g` (the
    engine fills it on the host while the forward runs), verifying the step's drafts and proposing the worker-side
    drafts, and returns its `ModelRunnerOutput`. With `non_block=True` either returns a handle whose `result()`
    waits for that value: for `sample_tokens`, the step's one host synchronization.

    A step may be executed while an earlier one's output is not yet collected (async scheduling, pipeline batches):
    a row whose input token is still in flight reads it on the device, and every step collects normally. An output
    that only releases requests may be executed while steps are in flight (never between a step's two verbs): the
    worker drops those requests' state, and the steps in flight still collect."""

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | StepHandle | None: ...

    def sample_tokens(self, grammar_output: GrammarBitmask | None,
                      non_block: bool = False) -> ModelRunnerOutput | StepHandle: ...


@runtime_checkable
class CapturesGraphsWhileServing(Protocol):
    """A runner that captures its CUDA graphs once the engine serves (graph_capture="serving"): one before each
    step it executes, and one per `capture_next_graph` call, which the engine makes while it has nothing to run."""

    @property
    def graphs_pending(self) -> bool: ...

    def capture_next_graph(self) -> None: ...


def run_step(runner: Runner, scheduler_output: SchedulerOutput,
             grammar_output: GrammarBitmask | None = None) -> ModelRunnerOutput:
    """One step to its output, for callers that need no overlap (the bitmask, if any, is filled already)."""
    output = runner.execute_model(scheduler_output)
    return output if output is not None else runner.sample_tokens(grammar_output)
