"""Scheduler: one token budget per step; chunked prefill and preemption follow from it (pure Python).

Every request has `num_computed_tokens` catching up with `num_tokens`. Each step hands out the
budget to running requests first (in admission order), then admits waiting ones. A request that
cannot get blocks preempts the most recently admitted running request, which is freed and goes
back to the front of the waiting queue to be recomputed (its cached blocks usually survive).

Under the priority policy both queues stay sorted by (priority, arrival): the budget goes to the most important
running requests first, waiting ones are admitted in that order, and the preempted request, the last running one,
is the least important. Under shortest_prefill the running batch is kept the same way and waiting requests are
admitted shortest prompt first within a priority, with a starvation bound (waiting_queue.py).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from kestrel.config import CacheConfig, SchedulerConfig
from kestrel.engine.contracts import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kestrel.engine.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager
from kestrel.engine.step_cost import StepCostModel
from kestrel.engine.waiting_queue import WaitingQueue
from kestrel.kv_spec import KVCacheLayout, as_layout
from kestrel.request import Request, RequestStatus, end_outside_runs

# Under a step time target, the prefill tokens a step with decodes carries at least, so that prompts progress even
# where the decodes alone take the whole target.
MIN_PREFILL_CHUNK = 64


@dataclass
class SchedulerStats:
    num_steps: int = 0
    # Speculative decoding: verify steps of a request, draft tokens verified, drafts accepted (also by position).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    num_scheduled_tokens: int = 0  # tokens run through the model, over all steps
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Pipeline parallelism's batch queue: the most launched batches that were in flight at once.
    max_batches_in_flight: int = 0
    # expert_load_metrics: the runner's latest report, {MoE layer index: tokens routed to each expert since start}
    # (replaced, never changed in place, so a reader may keep a reference as its snapshot).
    expert_load: dict[int, list[int]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_cache: KVCacheLayout | int,
                 max_model_len: int, clock: Callable[[], float] = time.perf_counter) -> None:
        """`kv_cache`: the worker's KV cache layout (its groups and their blocks), or a block count for a model
        whose layers share one spec. `clock` times the steps for the step time target."""
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(as_layout(kv_cache, cache_config.block_size), cache_config.enable_prefix_caching)
        # The tokens that end a request by length: a stream (attention sinks + window) holds a bounded cache and may
        # run past max_model_len.
        self._context_limit = max_model_len if self.kv.streaming is None else 1 << 62
        self.waiting = WaitingQueue(scheduler_config.policy, scheduler_config.starvation_bound)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Requests whose runner state must be dropped at the next step.
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        # Requests the runner has seen since its last (re)admission.
        self._known_to_runner: set[str] = set()
        # Known requests whose computed count moved other than by their scheduled tokens (drafts rejected): their
        # next step carries a CachedRequestData even without new blocks.
        self._runner_count_stale: set[str] = set()
        self.stats = SchedulerStats()
        # Both policies that read `priority` keep the running batch in (priority, arrival) order, so the budget
        # goes to the most important first and the preempted request is the least important, latest arrival.
        self._by_priority = scheduler_config.policy in ("priority", "shortest_prefill")
        # Per step in flight, the requests it scheduled (by id): a step's tokens go to those objects only.
        self._scheduled: dict[int, dict[str, Request]] = {}
        self._step_ids = itertools.count(1)
        # The step time target: the steps' measured cost, and when the last step's results came (None: idle since).
        target = scheduler_config.step_time_target_ms
        self._step_target_s = target / 1e3 if target is not None else None
        self.step_cost = StepCostModel() if target is not None else None
        self._clock = clock
        self._last_step_done: float | None = None

    # ----- queue management -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self.stats.num_prompt_tokens += request.num_prompt_tokens

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (or abort) requests wherever they are; unknown or finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_pending_releases(self) -> bool:
        """Requests finished, aborted or preempted that the runner has not been told to drop yet."""
        return bool(self._finished_ids or self._preempted_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----- one step ---------------------------------------------------------------------------

    def schedule(self, exclude: Collection[str] = (), verify_drafts: bool = True,
                 draft_lookahead: int = 0) -> SchedulerOutput:
        """`exclude`: requests with work in flight (pipeline parallelism's batch queue); they are left out of this
        step instead of being scheduled with a placeholder for their pending token, and a waiting one holds back
        the waiting queue behind it (admission stays in order). `verify_drafts`: whether proposed drafts are
        verified (only in steps whose inputs are all known on the host). `draft_lookahead`: the positions past a
        step's tokens a worker-side proposer writes (k, or 0)."""
        budget = self.config.max_num_batched_tokens
        # Under a step time target with requests decoding: the budget the measured cost allows, and room kept for
        # each later running request's token when a running prefill takes its chunk (decodes are never starved).
        reserve = self._step_target_s is not None and self._any_decoding()
        if reserve:
            budget = self._timed_budget(budget)
        num_scheduled: dict[str, int] = {}
        scheduled: dict[str, Request] = {}  # the requests of num_scheduled, in its order
        admitted: list[Request] = []  # the waiting requests this step admits (the last of `scheduled`)
        spec: dict[str, list[int]] = {}
        proposing: set[str] = set()  # requests whose drafts the worker proposes after this step
        # The running requests' records for the runner, made as each is scheduled: every running request is known
        # to the runner (it was scheduled when admitted), so it needs a CachedRequestData only when more changed
        # than its scheduled tokens.
        cached: list[CachedRequestData] = []
        structured: list[str] = []
        every_known = self.kv.streaming is not None  # a stream's dropped blocks reach the runner with its record
        stale = self._runner_count_stale
        preempted_now = False
        running = self.running
        allocate = self.kv.allocate
        quiet_until = self.kv.quiet_until.get

        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            request_id = request.request_id
            if exclude and request_id in exclude:
                index += 1
                continue
            pending = request.num_pending_tokens
            computed = request.num_computed_tokens
            if pending and len(request.output_token_ids) + pending >= request.max_tokens:
                index += 1  # its token in flight is its last: it finishes when that token arrives
                continue
            remaining = len(request.all_token_ids) - request.num_dropped_tokens + pending - computed
            num_new = remaining if remaining < budget else budget
            if reserve and remaining > 1:
                num_new = min(num_new, budget - (len(running) - index - 1))
                if num_new <= 0:
                    index += 1  # a prefill chunk waits for a step with room beside the decodes
                    continue
            if request.media:
                num_new = end_outside_runs(request.media, computed, computed + num_new) - computed
                if not num_new:
                    index += 1  # the rest of a bidirectional image does not fit this step's budget
                    continue
            samples = num_new == remaining  # the step reaches the request's end: it samples the next token(s)
            drafts = (self._drafts_to_verify(request, num_new, budget)
                      if verify_drafts and request.spec_token_ids else ())
            lookahead = (self._lookahead(draft_lookahead, computed + num_new + len(drafts))
                         if draft_lookahead and samples else 0)
            if drafts or lookahead:
                block_ids = allocate(request, num_new + len(drafts), None, lookahead)
                if block_ids is None:
                    drafts, lookahead = (), 0  # drafts and the proposer's lookahead are optional: no preemption
                    block_ids = allocate(request, num_new)
                num_new += len(drafts)
            elif computed + num_new <= quiet_until(request_id, -1):
                block_ids = NO_NEW_BLOCKS  # what allocate would return, with nothing to do
            else:
                block_ids = allocate(request, num_new)
            while block_ids is None:
                victim = running.pop()
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
                block_ids = allocate(request, num_new)
            if block_ids is None:
                break
            computed = request.num_computed_tokens  # a stream's allocation moves it down by the tokens it drops
            num_scheduled[request_id] = num_new
            scheduled[request_id] = request
            if request.sampling_params.structured_outputs is not None:
                structured.append(request_id)
            if block_ids or every_known or request_id in stale:
                stale.discard(request_id)
                cached.append(CachedRequestData(request_id, block_ids, computed, request.num_dropped_tokens))
            if drafts:
                spec[request_id] = drafts
            if request.spec_token_ids:
                request.spec_token_ids = []
            if lookahead:
                proposing.add(request_id)
            request.num_computed_tokens = computed + num_new
            if samples:
                request.num_pending_tokens = pending + 1
            budget -= num_new
            index += 1

        # After a preemption this step has no room to spare: admitting now would only thrash.
        while (self.waiting and budget > 0 and not preempted_now
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_pending_tokens or request.request_id in exclude:
                break  # preempted with a token in flight: readmitted once that token is known
            cached_prefix, num_cached = self.kv.find_cached_prefix(request)
            num_new = request.num_kv_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if request.media:
                num_new = end_outside_runs(request.media, num_cached, num_cached + num_new) - num_cached
                if not num_new:
                    break  # its first chunk would cut an image computed both ways: admitted when the budget allows
            end = num_cached + num_new
            lookahead = self._lookahead(draft_lookahead, end) if end == request.num_kv_tokens else 0
            block_ids = self.kv.allocate(request, num_new, cached_prefix, lookahead=lookahead)
            if block_ids is None and lookahead:
                lookahead = 0
                block_ids = self.kv.allocate(request, num_new, cached_prefix)
            if block_ids is None:
                break
            if lookahead:
                proposing.add(request.request_id)
            self.waiting.pop_head()
            self.kv.count_prefix_lookup(request, num_cached)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            if self._by_priority:
                bisect.insort(self.running, request, key=_priority_key)
            else:
                self.running.append(request)
            num_scheduled[request.request_id] = num_new
            scheduled[request.request_id] = request
            admitted.append(request)
            budget -= num_new

        output = self._build_output(num_scheduled, scheduled, admitted, cached, structured, spec, proposing,
                                    draft_lookahead)
        for request in admitted:
            request.num_computed_tokens += num_scheduled[request.request_id]
            if request.spec_token_ids:
                request.spec_token_ids = []  # drafts taken while it waited (preempted in flight) are not verified
            if request.num_computed_tokens == request.num_kv_tokens + request.num_pending_tokens:
                request.num_pending_tokens += 1  # this step samples the request's first token
        if not output.is_empty:
            self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += output.total_num_scheduled_tokens
        return output

    def _any_decoding(self) -> bool:
        return any(r.num_kv_tokens + r.num_pending_tokens - r.num_computed_tokens <= 1 for r in self.running)

    def _timed_budget(self, budget: int) -> int:
        """The step's token budget under the step time target: the most tokens the fitted step cost fits in it,
        at least the running requests' one token each and MIN_PREFILL_CHUNK more, at most `budget`; `budget` until
        a step with a prefill chunk has been timed."""
        assert self.step_cost is not None and self._step_target_s is not None
        fits = self.step_cost.tokens_within(self._step_target_s)
        if fits is None:
            return budget
        return min(budget, max(fits, len(self.running) + MIN_PREFILL_CHUNK))

    def _time_step(self, scheduler_output: SchedulerOutput) -> None:
        """A step's results arrived: the time since the previous step's is this step's cost, as its decoding
        requests see it (the engine stayed busy in between: it is reset whenever the engine runs out of work). Only
        steps that carry a prefill chunk are fitted: those are the steps the budget cuts, and on a GPU a decode-only
        step runs as a CUDA graph whose cost says little about an eager mixed step's."""
        assert self.step_cost is not None
        now = self._clock()
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if self._last_step_done is not None and num_tokens > len(scheduler_output.num_scheduled_tokens):
            self.step_cost.observe(num_tokens, now - self._last_step_done)
        self._last_step_done = now

    def _drafts_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposed tokens a decoding request verifies this step: as many as the budget, its max_tokens and
        the context leave room for (the step also samples one token of its own)."""
        if not request.spec_token_ids or num_new != 1 or request.num_pending_tokens:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        return request.spec_token_ids[:max(room, 0)]

    def _lookahead(self, draft_lookahead: int, end: int) -> int:
        """Positions the draft proposer writes past a step's tokens (which end at position `end`) for a request
        the step samples: up to `draft_lookahead`, within max_model_len."""
        return max(min(draft_lookahead, self.max_model_len - end), 0)

    def _build_output(self, num_scheduled: dict[str, int], scheduled: dict[str, Request], admitted: list[Request],
                      cached: list[CachedRequestData], structured: list[str], spec: dict[str, list[int]],
                      proposing: set[str], draft_lookahead: int) -> SchedulerOutput:
        """The step's output: `cached` and `structured` hold the running requests' records already; the requests
        `admitted` this step (the last of `scheduled`) are new to the runner."""
        new = []
        for request in admitted:
            request_id = request.request_id
            if request.sampling_params.structured_outputs is not None:
                structured.append(request_id)
            new.append(NewRequestData(
                req_id=request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv.block_ids(request_id),
                num_computed_tokens=request.num_computed_tokens,
                pooling_params=request.pooling_params,
                num_dropped_tokens=request.num_dropped_tokens,
                media=request.media,
            ))
            self._known_to_runner.add(request_id)
        output = SchedulerOutput(
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=frozenset(self._finished_ids),
            preempted_req_ids=frozenset(self._preempted_ids),
            scheduled_spec_decode_tokens=spec,
            structured_output_request_ids=frozenset(structured),
            draft_request_ids=frozenset(proposing),
            draft_lookahead=draft_lookahead if proposing else 0,
            step_id=next(self._step_ids),
        )
        if scheduled:
            self._scheduled[output.step_id] = scheduled
        self._finished_ids.clear()
        self._preempted_ids.clear()
        return output

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Append each request's new tokens, applying the stop rules token by token (the first hit ends the
        request and drops the tokens after it), and free finished requests. Draft tokens the step rejected
        give back their KV slots: the request's computed tokens fall back to what was accepted.

        Returns the requests that received a token this step (finished ones included).
        """
        if self.step_cost is not None:
            self._time_step(scheduler_output)
        updated = []
        now = time.monotonic()
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if runner_output.expert_load is not None:
            self.stats.expert_load = runner_output.expert_load
        scheduled = self._scheduled.pop(scheduler_output.step_id, None)
        # The request this step scheduled under an id, if it is still here (an id may be reused by a new request
        # once the old one was aborted, even while this step was in flight).
        requests = self.requests if scheduled is None else scheduled
        live = self.requests

        # Before the tokens: the step that ends a prompt can also finish its request.
        for request_id, logprobs in runner_output.prompt_logprobs.items():
            request = requests.get(request_id)
            if request is not None and live.get(request_id) is request:
                request.prompt_logprobs.extend(logprobs)
        pooled = runner_output.pooled
        all_logprobs = runner_output.logprobs
        stop_status = self._stop_status
        context_limit = self._context_limit
        num_generated = 0
        for i, (request_id, tokens) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            if not tokens:
                continue
            request = requests.get(request_id)
            if request is None or live.get(request_id) is not request:
                continue
            if pooled and request_id in pooled:
                request.pooled_output = pooled[request_id]
            if request.num_pending_tokens:
                request.num_pending_tokens -= 1
            if drafts:
                verified = drafts.get(request_id, ())
                num_rejected = len(verified) + 1 - len(tokens)
                if verified:
                    self._count_acceptance(len(verified), len(tokens) - 1)
                if num_rejected > 0 and request.status == RequestStatus.RUNNING:
                    request.num_computed_tokens -= num_rejected
                    self._runner_count_stale.add(request_id)
            if request.status.finished:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            if request.pooled_output is not None:  # its result is the pooled state: no token is generated
                self._finish_queued(request, RequestStatus.FINISHED_STOPPED)
                updated.append(request)
                continue
            output_token_ids, all_token_ids = request.output_token_ids, request.all_token_ids
            stopping_ids, max_tokens = request.stopping_ids, request.max_tokens
            appended = 0
            for token_id in tokens:
                output_token_ids.append(token_id)  # Request.append_output_token, inline: once per token
                all_token_ids.append(token_id)
                appended += 1
                # _stop_status's own tests, inline: it is called only where one of them may stop the request.
                if not (token_id in stopping_ids or len(output_token_ids) >= max_tokens
                        or len(all_token_ids) >= context_limit):
                    continue
                status = stop_status(request, token_id)
                if status is not None:
                    self._finish_queued(request, status)
                    break
            num_generated += appended
            if all_logprobs and all_logprobs[i] is not None:
                request.output_logprobs.extend(entry for entry in all_logprobs[i][:appended] if entry is not None)
            updated.append(request)
        self.stats.num_generation_tokens += num_generated
        if self.step_cost is not None and not self.has_unfinished_requests():
            self._last_step_done = None  # idle: the next step's time would include the wait for requests
        return updated

    def _count_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_spec_drafts += 1
        stats.num_spec_draft_tokens += num_drafts
        stats.num_spec_accepted_tokens += num_accepted
        per_position = stats.spec_accepted_per_position
        per_position.extend([0] * (num_drafts - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        """Past min_tokens, an ending EOS id (first) or a stop_token_id (its stop_reason); else the length limits.
        `update` calls it only for a token in `stopping_ids` or at a length limit (its tests repeat these)."""
        num_output = len(request.output_token_ids)
        if token_id in request.stopping_ids and num_output >= request.sampling_params.min_tokens:
            if token_id not in request.ending_eos_ids:
                request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or len(request.all_token_ids) >= self._context_limit:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.prompt_logprobs = []  # recomputation produces them again
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.add_preempted(request)
        self._runner_count_stale.discard(request.request_id)
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._preempted_ids.add(request.request_id)

    def _finish_queued(self, request: Request, status: RequestStatus) -> None:
        """`_finish` a request the step's results end, out of the queue it is in: the running one, or the waiting
        one where it was preempted while its token was in flight (async scheduling)."""
        (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._runner_count_stale.discard(request.request_id)
        # A request preempted earlier may still have state on the runner (a seeded generator kept for its return).
        if request.request_id in self._known_to_runner or request.num_preemptions:
            self._known_to_runner.discard(request.request_id)
            self._finished_ids.add(request.request_id)


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority_key
