"""EngineCore: schedule -> runner.execute_model -> runner.sample_tokens -> scheduler.update -> detokenize ->
RequestOutputs (pure Python).

The tokenizer is passed in (duck-typed), so this module never imports torch or transformers.
A request with `n > 1` is fanned out into n sequences that share the prompt (and its cached blocks)
and gathered back into one RequestOutput.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kestrel.config import EngineConfig
from kestrel.engine.contracts import (
    CapturesGraphsWhileServing,
    ModelRunnerOutput,
    Ready,
    Runner,
    SchedulerOutput,
    StepHandle,
    run_step,
)
from kestrel.engine.detokenizer import IncrementalDetokenizer, TokenizerLookups
from kestrel.engine.ngram_proposer import propose
from kestrel.engine.scheduler import Scheduler
from kestrel.kv_spec import KVCacheLayout, as_layout
from kestrel.outputs import CompletionOutput, RequestMetrics, RequestOutput, SequenceDelta, delta_completion
from kestrel.pooling_params import PoolingParams
from kestrel.request import InvalidRequestError, MediaItem, Request, RequestStatus, check_media, prompt_too_long
from kestrel.sampling_params import SamplingParams, sibling_seed


@dataclass
class _Sequence:
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None: the engine's client detokenizes (detokenize=False)
    index: int
    status: RequestStatus = RequestStatus.WAITING
    finished_time: float | None = None
    num_emitted_tokens: int = 0
    num_named_logprobs: int = 0  # output logprob entries whose tokens carry their text
    num_named_prompt_logprobs: int = 0
    num_grammar_tokens: int = 0  # output tokens its grammar matcher has accepted (or, thinking, passed over)
    grammar_state: int = 0  # _GRAMMAR_ON, or where a thinking ahead of it stands (after_thinking)
    finish_emitted: bool = False  # output_kind="delta": its finish has been handed out
    logprob_sum: float = 0.0  # output_kind="delta": the sampled tokens' logprobs emitted so far, summed

    def __post_init__(self) -> None:
        # Read for every sequence and step, so plain attributes rather than the params' properties.
        params = self.request.sampling_params
        self.final_only = params.final_only
        self.delta_outputs = params.delta_outputs
        # Between its first delta and its last, each of its deltas carries its new tokens only.
        self.tokens_only = (params.logprobs is None and params.prompt_logprobs is None
                            and self.request.pooling_params is None)


@dataclass
class _ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)
    prompt_logprobs_emitted: bool = False  # output_kind="delta": they went out with an earlier output
    metrics: RequestMetrics | None = None  # the metrics its last output carried

    @property
    def finished(self) -> bool:
        return all(seq.status.finished for seq in self.sequences)


logger = logging.getLogger(__name__)

# Where a constrained sequence's grammar stands (StructuredOutputsParams.after_thinking): applied to every token;
# its first token may open a thinking (the grammar's first mask also allows the start tag); inside the thinking
# (no mask: the grammar applies from the token after the end tag).
_GRAMMAR_ON, _MAY_THINK, _THINKING = 0, 1, 2

# What a step returns: RequestOutputs, or SequenceDeltas for an engine built with deltas=True.
EngineOutput = RequestOutput | SequenceDelta

_new_tuple = tuple.__new__

_NOTHING_PLACED = ("the scheduler could not place any request; the KV cache is too small for the waiting "
                   "prompts")



def bad_word_sequences(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word's token ids as the model would write it mid-text (after a space) and at the start."""
    sequences: list[list[int]] = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            ids = list(tokenizer.encode(variant, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _needs_latest_tokens(params: SamplingParams) -> bool:
    """Sampling that reads the request's tokens on the host each step cannot lag one step behind."""
    return (params.has_penalties or params.min_tokens > 0 or params.prompt_logprobs is not None
            or bool(params.bad_words_token_ids))


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, kv_cache: KVCacheLayout | int, tokenizer: Any,
                 eos_token_id: int | None, structured: Any = None, detokenize: bool = True,
                 deltas: bool = False) -> None:
        """`kv_cache`: the runner's KV cache layout (or its block count, for one group).
        `structured`: the grammar backend of structured outputs (kestrel.structured), duck-typed.
        `detokenize=False`: outputs carry token ids only (no text, no stop strings, no logprob token texts).
        `deltas=True` (with detokenize=False): a step returns SequenceDeltas, each sequence's new tokens, instead of
        RequestOutputs; requests have one sequence (n = 1). The engine core in its own process, whose client
        fans out n, detokenizes and builds the outputs."""
        if deltas and detokenize:
            raise ValueError("deltas=True carries token ids only: it needs detokenize=False")
        max_model_len = config.model.max_model_len or 0
        kv_layout = as_layout(kv_cache, config.cache.block_size)
        kv_layout.check_holds(max_model_len)
        if not isinstance(runner, Runner):
            raise TypeError(f"{type(runner).__name__} is not a Runner: the engine calls its execute_model("
                            "scheduler_output, non_block) and sample_tokens(grammar_output, non_block)")
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.structured = structured
        self.detokenize = detokenize
        self.deltas = deltas
        self.eos_token_id = eos_token_id
        # The model's generation_config.json: more EOS ids, and default sampling settings (for the entrypoints).
        self.generation_defaults = config.model.generation_defaults
        self._extra_eos = self.generation_defaults.eos_token_ids - {eos_token_id}
        # Every id that ends generation: the tokenizer's EOS and generation_config.json's.
        self.eos_token_ids = self._extra_eos | ({eos_token_id} - {None})
        self.max_model_len = max_model_len
        self.num_blocks = kv_layout.min_num_blocks
        self.scheduler = Scheduler(config.scheduler, config.cache, kv_layout, max_model_len)
        self._parents: dict[str, _ParentRequest] = {}
        self._sequence_parent: dict[str, _ParentRequest] = {}
        self.async_scheduling = config.scheduler.async_scheduling
        if self.async_scheduling is None:  # automatic: worth it when a device runs the steps
            self.async_scheduling = getattr(getattr(runner, "device", None), "type", "cpu") != "cpu"
        # Pipeline parallelism: up to pp batches in flight (vLLM's batch queue), each scheduled from the requests
        # with nothing in flight. Async scheduling: two, the second reading the first's tokens on the device.
        self.pipelined = config.parallel.pipeline_parallel_size > 1 and config.scheduler.async_scheduling is not False
        if self.pipelined:
            self.async_scheduling = False
            self.max_batches_in_flight = config.parallel.pipeline_parallel_size
        else:
            self.max_batches_in_flight = 2 if self.async_scheduling else 1
        # The steps sampled but not yet collected, oldest first, and (pipelined) the requests they hold.
        self._batch_queue: deque[tuple[SchedulerOutput, StepHandle]] = deque()
        self._in_flight_ids: set[str] = set()
        # Live requests whose sampling reads their latest tokens on the host (usually none): kept here so a
        # step need not scan every request; finished ones are dropped lazily by `_needs_sync`.
        self._sync_request_ids: set[str] = set()
        self._token_texts: dict[int, str] = {}
        # Constrained sequences whose grammar waits on a thinking (usually none), by request id.
        self._thinking: dict[str, _Sequence] = {}

    # ----- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    prompt: str | None = None, priority: int = 0, grammar: Any = None,
                    media: tuple[MediaItem, ...] = (), cache_salt: str | None = None) -> None:
        """`priority`: under the priority scheduling policy, lower values are served first. `grammar`: the
        compiled grammar of `params.structured_outputs` (opaque here: the grammar backend's), so that the engine
        does not compile it; None: the backend compiles it. PoolingParams instead of SamplingParams: the request
        runs its prompt and its output carries the pooled final hidden state (`RequestOutput.pooled`); its
        fields left None take the model's pooler settings. `media`: the prompt's images, each with the placeholder
        positions its embeddings fill (the entry points' processor expanded them). `cache_salt` (vLLM's): a request
        finds in the prefix cache only blocks that requests with the same salt computed."""
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is None and self.config.model.runner == "pooling":
            raise InvalidRequestError("model", "this engine runs the pooling runner (runner='pooling', --runner "
                                      "pooling): it embeds, scores and classifies but does not generate; serve "
                                      "the model with --runner generate to generate text")
        if pooling is not None:
            # A generation model embeds as vLLM pools a decoder asked for embeddings: last token, normalized.
            pooler = self.config.model.pooler
            pooling = (pooling.with_defaults(pooler.pooling_type, pooler.normalize) if pooler is not None
                       else pooling.with_defaults("LAST", True))
            params = pooling.run_params()
        if getattr(params, "truncate_prompt_tokens", None) is not None:
            raise InvalidRequestError("truncate_prompt_tokens", "the engine takes prompts already cut; "
                                      "truncate_prompt_tokens is applied by LLM, AsyncLLM and the server")
        self._validate(request_id, prompt_token_ids, params, pooling is not None)
        media = tuple(media)
        check_media(media, len(prompt_token_ids))
        if media and not getattr(self.runner, "supported_modalities", frozenset()):
            raise InvalidRequestError("multi_modal_data", "this model takes text only; send the prompt without "
                                      "images")
        if media and getattr(self.runner, "bidirectional_media", False):
            media = self._bidirectional(media)
        if getattr(self.runner, "encoder_decoder", False) and len(media) != 1:
            raise InvalidRequestError("multi_modal_data", f"this model is an encoder-decoder (Whisper): a request "
                                      f"is one audio clip and its decoder prompt, got {len(media)} media items")
        self._check_priority(priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt", f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if self.deltas and params.n != 1:
            raise InvalidRequestError("n", f"this engine core takes one sequence per request (its client fans out "
                                      f"n), got n={params.n}")
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.replace(bad_words_token_ids=self._bad_word_sequences(params.bad_words))
        parent = _ParentRequest(request_id, prompt, list(prompt_token_ids))
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            child_params = params
            if params.n > 1:
                # Distinct seeds keep seeded siblings from sampling identical sequences.
                child_params = params.replace(n=1, seed=sibling_seed(params.seed, index))
            request = Request(child_id, list(prompt_token_ids), child_params, eos_token_id=self.eos_token_id,
                              max_model_len=None if self.config.streaming else self.max_model_len,
                              extra_eos_token_ids=self._extra_eos,
                              priority=priority, pooling_params=pooling, media=media, cache_salt=cache_salt)
            detokenizer = (IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, child_params,
                                                  TokenizerLookups.of(self.tokenizer))
                           if self.detokenize and params.detokenize else None)
            sequence = _Sequence(request, detokenizer, index)
            parent.sequences.append(sequence)
        if params.structured_outputs is not None:
            self._add_grammars(parent, params, grammar)
            tags = params.structured_outputs.after_thinking
            if tags is not None:
                for sequence in parent.sequences:
                    sequence.grammar_state = _THINKING if tags.open else _MAY_THINK
                    self._thinking[sequence.request.request_id] = sequence
        for sequence in parent.sequences:
            self._sequence_parent[sequence.request.request_id] = parent
        self._parents[request_id] = parent
        for sequence in parent.sequences:
            self.scheduler.add_request(sequence.request)
            if _needs_latest_tokens(params):
                self._sync_request_ids.add(sequence.request.request_id)

    def _bidirectional(self, media: tuple[MediaItem, ...]) -> tuple[MediaItem, ...]:
        """The items of a model whose placeholder runs attend to themselves both ways: each run is computed in one
        step, so one longer than the step's token budget could never be, and is refused."""
        budget = self.config.scheduler.max_num_batched_tokens
        for index, item in enumerate(media):
            longest = max(length for _, length in item.ranges)
            if longest > budget:
                raise InvalidRequestError(f"multi_modal_data[{index}]", f"an image of {longest} placeholder tokens "
                                          "attends to itself both ways and is computed in one step, which takes at "
                                          f"most max_num_batched_tokens={budget} tokens; raise "
                                          "--max-num-batched-tokens")
        return tuple(dataclasses.replace(item, bidirectional=True) for item in media)

    def _add_grammars(self, parent: _ParentRequest, params: SamplingParams, grammar: Any = None) -> None:
        """A matcher per sequence on `grammar`, else on the grammar compiled once (cached); all or none."""
        if self.structured is None:
            raise InvalidRequestError("structured_outputs", "this engine has no grammar backend for structured "
                                      "outputs")
        added = []
        try:
            for sequence in parent.sequences:
                self.structured.add(sequence.request.request_id, params.structured_outputs, grammar)
                added.append(sequence.request.request_id)
        except BaseException:
            for request_id in added:
                self.structured.remove(request_id)
            raise

    def _bad_word_sequences(self, words: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words", "bad_words needs the model's tokenizer")
        return bad_word_sequences(self.tokenizer, words)

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError("priority", f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduler.policy == "fcfs":
            raise InvalidRequestError("priority", f"priority={priority} needs priority scheduling, and this engine "
                                      "schedules first come, first served; start it with scheduling_policy="
                                      "'priority' (--scheduling-policy priority, or shortest_prefill) or leave "
                                      "priority at 0")

    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  pooling: bool = False) -> None:
        """`pooling`: a pooling request, whose prompt may fill the context (the token it samples is not kept)."""
        if request_id in self._parents:
            raise InvalidRequestError("request_id", f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty; give at least one token")
        streaming = self.config.streaming
        if streaming is not None:
            if len(prompt_token_ids) > streaming.num_kept_tokens:
                raise InvalidRequestError("prompt", f"the prompt has {len(prompt_token_ids)} tokens but the engine "
                                          f"streams with streaming_window sink_tokens={streaming.sink_tokens} + "
                                          f"window={streaming.window} = {streaming.num_kept_tokens} tokens attended; "
                                          f"shorten the prompt to at most {streaming.num_kept_tokens} tokens")
        elif len(prompt_token_ids) >= self.max_model_len + pooling:
            raise prompt_too_long(len(prompt_token_ids), self.max_model_len, generates=not pooling)
        vocab_size = getattr(self.runner, "vocab_size", None)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise InvalidRequestError("prompt_token_ids", f"token ids must be in [0, {vocab_size})")
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and vocab_size is not None and asked > vocab_size:
                raise InvalidRequestError(name, f"{name}={asked} is more than the vocabulary's {vocab_size} tokens")
            if asked is not None and limit >= 0 and asked > limit:
                raise InvalidRequestError(name, f"{name}={asked} is more than this engine's max_logprobs={limit}; ask "
                                          f"for at most {limit}, or start the engine with a larger max_logprobs "
                                          "(-1: no limit)")
        bias = params.logit_bias or {}
        if vocab_size is not None and any(t >= vocab_size for t in bias):
            raise InvalidRequestError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size})")
        for name in ("allowed_token_ids", "stop_token_ids"):  # an id past the vocabulary is never sampled
            if vocab_size is not None and any(t >= vocab_size for t in getattr(params, name) or ()):
                raise InvalidRequestError(name, f"{name} must be in [0, {vocab_size})")
        tags = params.structured_outputs.after_thinking if params.structured_outputs is not None else None
        if tags is not None and vocab_size is not None and max(tags.start_token_id, tags.end_token_id) >= vocab_size:
            raise InvalidRequestError("structured_outputs.after_thinking", f"the thinking's token ids must be in "
                                      f"[0, {vocab_size}), got {tags.start_token_id} and {tags.end_token_id}")

    def abort_request(self, request_ids: list[str]) -> list[EngineOutput]:
        """End the requests now; returns each one's final output (finish_reason "abort" for the sequences it cut,
        its text and tokens so far), for a reader still waiting on it: a SequenceDelta with the tokens not yet
        sent from an engine core whose client builds the outputs (deltas=True)."""
        finals: list[EngineOutput] = []
        now = time.monotonic()
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            self.scheduler.finish_requests([seq.request.request_id for seq in parent.sequences],
                                           RequestStatus.FINISHED_ABORTED)
            for sequence in parent.sequences:
                if not sequence.status.finished:  # (a finished one has ended already)
                    if sequence.detokenizer is not None:
                        self._detokenize(sequence)  # a final-only request's text is otherwise made at its end
                    sequence.status = sequence.request.status
                    self._sequence_ended(sequence.request, sequence, now)
            finals.append(self._make_delta(parent, True) if self.deltas else self._make_output(parent, True))
        if not self.has_unfinished_requests():
            self._release_finished()
        return finals

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's, for benchmarks that must not reuse one); only while no request
        holds a block: False otherwise."""
        return self.scheduler.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    @property
    def has_idle_work(self) -> bool:
        """Whether the runner has CUDA graphs left to capture (graph_capture="serving") and no step is in flight (a
        capture waits for the device): a loop with no request to run calls `do_idle_work` instead of waiting."""
        runner = self.runner
        return (not self._batch_queue and isinstance(runner, CapturesGraphsWhileServing)
                and runner.graphs_pending)

    def do_idle_work(self) -> None:
        """Capture the runner's next pending CUDA graph, if any."""
        if self.has_idle_work:
            self.runner.capture_next_graph()

    def finish_idle_work(self) -> None:
        """Capture every pending CUDA graph now (benchmarks, before they time steps)."""
        while self.has_idle_work:
            self.runner.capture_next_graph()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ----- the step -----------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Run one scheduled step; return an output for every request that made progress (for
        `output_kind="final_only"` requests, only once they finish).

        Every mode is an ordering of the runner's two verbs, `execute_model` then `sample_tokens`. Synchronous
        (and speculative verification): one step executed, its grammar bitmask filled while the forward runs,
        sampled and collected. Async scheduling and pipeline batches (`_step_with_batch_queue`): a step is sampled
        without waiting and collected later, so the outputs returned are those of an earlier step; a batch that
        needs the host's view of every token (penalties, min_tokens, prompt logprobs, drafts to verify) first
        collects what is in flight, then runs synchronously.

        Every request the scheduler finishes, aborts or preempts reaches the runner's release list with the
        next scheduler output, even one with nothing to compute: the runner's rows then never outnumber the
        scheduler's running requests, whatever finished while a step was in flight. An engine left idle
        releases them at once, so the runner holds no state between bursts."""
        if self.max_batches_in_flight > 1 and not self._needs_sync():
            outputs = self._step_with_batch_queue()
        else:
            outputs = self._drain() + self._step_sync()
        if not self.has_unfinished_requests():
            self._release_finished()
        return outputs

    def _step_sync(self) -> list[EngineOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        spec = self.config.speculative
        speculating = self._speculating()
        if speculating and not spec.uses_model:
            self._propose_drafts()
        # A worker-side proposer drafts for the step after this one, into `draft_lookahead` positions of scratch.
        lookahead = spec.num_speculative_tokens if speculating and spec.uses_model else 0
        scheduler_output = self.scheduler.schedule(draft_lookahead=lookahead)
        if scheduler_output.is_empty:
            raise RuntimeError(_NOTHING_PLACED)
        executed = self.runner.execute_model(scheduler_output, non_block=True)
        grammar = self._grammar_bitmask(scheduler_output)  # filled on the host while the forward runs
        output = executed.result()
        if output is None:
            output = self.runner.sample_tokens(grammar)
        return self._process(scheduler_output, output)

    def _step_with_batch_queue(self) -> list[EngineOutput]:
        """Async scheduling and pipeline parallelism, as vLLM's batch queue: while fewer than
        `max_batches_in_flight` steps are in flight, schedule one more, execute it and sample it without waiting;
        collect the oldest only when the queue is full or nothing else can be scheduled.

        Async scheduling (two in flight): step N+1 is scheduled and launched before step N's tokens reach the host
        (its rows read them on the device), then N is collected. A constrained N+1 needs N's tokens in its grammars
        before its bitmask: its forward runs while the host collects N and feeds them, then N+1 is sampled, and
        only then do N's text and outputs follow (nothing of N+1 waits on them; a stop string found there ends its
        request as one finished in flight). Pipeline parallelism (pp in flight): each batch is scheduled from the
        requests with nothing in flight (their tokens are all known, so no placeholder is read on the device and
        every stage can start it at once; a constrained batch gets its bitmask at launch), and the stages each work
        on a different batch."""
        queue = self._batch_queue
        unsampled: SchedulerOutput | None = None  # executed; sampled once the oldest step is collected
        if len(queue) < self.max_batches_in_flight and self.scheduler.has_unfinished_requests():
            # A step launched before the previous one's tokens are known neither verifies nor proposes drafts.
            exclude = self._in_flight_ids if self.pipelined else ()
            scheduler_output = self.scheduler.schedule(exclude=exclude, verify_drafts=False)
            if not scheduler_output.is_empty:
                output = self.runner.execute_model(scheduler_output)
                if output is not None:
                    self._enqueue(scheduler_output, Ready(output))
                elif queue and not self.pipelined and self._constrained(scheduler_output):
                    unsampled = scheduler_output
                else:
                    self._enqueue(scheduler_output, self._sample(scheduler_output))
                if unsampled is None and len(queue) < self.max_batches_in_flight:
                    return []
            elif scheduler_output.releases_requests:
                # Nothing to compute (every running request waits on its token in flight), but the releases must
                # reach the runner before a later step admits into their rows.
                self.runner.execute_model(scheduler_output)
        if not queue:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError(_NOTHING_PLACED)
            return []
        if unsampled is None:
            outputs = self._process(*self._collect_oldest())
        else:
            updated = self._advance(*self._collect_oldest())
            self._enqueue(unsampled, self._sample(unsampled))
            outputs = self._emit(updated)
        if queue and not self.scheduler.has_unfinished_requests():
            # Every request of the steps in flight has finished meanwhile: settle them now, so an idle engine
            # holds nothing in flight.
            outputs += self._drain()
        return outputs

    def _sample(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Sample an executed step without waiting for it, its constrained rows masked by their bitmask."""
        return self.runner.sample_tokens(self._grammar_bitmask(scheduler_output), non_block=True)

    def _enqueue(self, scheduler_output: SchedulerOutput, handle: StepHandle) -> None:
        self._batch_queue.append((scheduler_output, handle))
        if self.pipelined:
            self._in_flight_ids.update(scheduler_output.num_scheduled_tokens)
            stats = self.scheduler.stats
            stats.max_batches_in_flight = max(stats.max_batches_in_flight, len(self._batch_queue))

    def _collect_oldest(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """The oldest step in flight and its output (the wait for its ids)."""
        scheduler_output, handle = self._batch_queue.popleft()
        if self.pipelined:
            self._in_flight_ids.difference_update(scheduler_output.num_scheduled_tokens)
        return scheduler_output, handle.result()

    def _drain(self) -> list[EngineOutput]:
        """Collect every step in flight, oldest first (before a step that must run alone)."""
        outputs: list[EngineOutput] = []
        while self._batch_queue:
            outputs += self._process(*self._collect_oldest())
        return outputs

    def _constrained(self, scheduler_output: SchedulerOutput) -> bool:
        return bool(scheduler_output.structured_output_request_ids) and self.structured is not None

    def _grammar_bitmask(self, scheduler_output: SchedulerOutput) -> Any:
        """The step's constrained rows, in batch order (a request verifying drafts has one per position); None
        when it has none."""
        if not self._constrained(scheduler_output):
            return None
        constrained = scheduler_output.structured_output_request_ids
        ids = [rid for rid in scheduler_output.num_scheduled_tokens if rid in constrained]
        drafts = scheduler_output.scheduled_spec_decode_tokens
        thinking = self._thinking
        if not thinking:
            return self.structured.bitmask(ids, drafts)
        # A sequence inside its thinking samples unmasked; one whose first token may open it gets the start tag
        # allowed beside its grammar's first tokens.
        ids = [rid for rid in ids if rid not in thinking or thinking[rid].grammar_state != _THINKING]
        if drafts:
            masked = set(ids)
            drafts = {rid: d for rid, d in drafts.items() if rid in masked}
        mask = self.structured.bitmask(ids, drafts)
        for row, rid in enumerate(mask.req_ids):
            sequence = thinking.get(rid)
            if sequence is not None and sequence.grammar_state == _MAY_THINK:
                start = sequence.request.sampling_params.structured_outputs.after_thinking.start_token_id
                word, bit = divmod(start, 32)
                mask.bitmask[row, word] |= (1 << bit) - ((1 << 32) if bit == 31 else 0)  # int32 words
        return mask

    def _release_finished(self) -> None:
        """Tell the runner to drop the state of requests that ended since the last step (engine idle)."""
        if self.scheduler.has_pending_releases:
            scheduler_output = self.scheduler.schedule()
            assert scheduler_output.is_empty, "an idle engine scheduled work"
            run_step(self.runner, scheduler_output)

    def _speculating(self) -> bool:
        spec = self.config.speculative
        if spec is None or not self.scheduler.running:
            return False
        return spec.disable_by_batch_size is None or self.scheduler.num_running <= spec.disable_by_batch_size

    def _propose_drafts(self) -> None:
        """N-gram proposals for the running requests that decode this step (verified in it)."""
        spec = self.config.speculative
        for request in self.scheduler.running:
            decoding = request.num_computed_tokens == request.num_tokens - 1
            if decoding and not request.num_pending_tokens:
                drafts = propose(request.all_token_ids, spec.num_speculative_tokens, spec.prompt_lookup_min,
                                 spec.prompt_lookup_max)
                request.spec_token_ids = self._grammar_drafts(request, drafts)

    def _take_worker_drafts(self, runner_output: ModelRunnerOutput, updated: list[Request]) -> None:
        """Drafts the worker's proposer made for the next step (draft model, EAGLE head), once the step's tokens
        (and the grammars) have advanced; only for the requests the step advanced (`updated`)."""
        advanced = {request.request_id: request for request in updated}
        for request_id, drafts in runner_output.draft_token_ids.items():
            request = advanced.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING and drafts:
                request.spec_token_ids = self._grammar_drafts(request, drafts)

    def _grammar_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        if drafts and request.sampling_params.structured_outputs is not None and self.structured:
            thinking = self._thinking.get(request.request_id)
            if thinking is not None:
                # Drafts inside the thinking are free; its end and what follows wait for the grammar: a step
                # then ends with the end tag at the latest, and the next one's mask comes after it.
                if thinking.grammar_state != _THINKING:
                    return []
                end = request.sampling_params.structured_outputs.after_thinking.end_token_id
                return drafts[:drafts.index(end)] if end in drafts else drafts
            return self.structured.valid_drafts(request.request_id, drafts)  # only what the grammar allows
        return drafts

    def _needs_sync(self) -> bool:
        if self._speculating():
            return True  # a verify step must know the tokens it proposes from
        if self._sync_request_ids:
            live = self.scheduler.requests  # unfinished requests, waiting or running
            self._sync_request_ids = {rid for rid in self._sync_request_ids if rid in live}
        return bool(self._sync_request_ids)

    def _process(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineOutput]:
        return self._emit(self._advance(scheduler_output, runner_output))

    def _advance(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """The step's tokens into the scheduler and the grammars: what the next step's sampling depends on.
        Returns the requests that received tokens."""
        updated = self.scheduler.update(scheduler_output, runner_output)
        if scheduler_output.structured_output_request_ids and self.structured is not None:
            self._advance_grammars(updated)
        if runner_output.draft_token_ids:
            self._take_worker_drafts(runner_output, updated)
        return updated

    def _emit(self, updated: list[Request]) -> list[EngineOutput]:
        """Text, stop strings and RequestOutputs of the requests a step advanced (`_advance`)."""
        if self.deltas:
            return self._emit_deltas(updated)
        touched: dict[str, _ParentRequest] = {}
        now = time.monotonic()
        sequence_parent = self._sequence_parent
        for request in updated:
            request_id = request.request_id
            parent = sequence_parent.get(request_id)
            if parent is None:
                continue
            sequences = parent.sequences
            sequence = sequences[0] if len(sequences) == 1 else next(s for s in sequences if s.request is request)
            params = request.sampling_params
            detokenize = sequence.detokenizer is not None  # the engine's and the request's detokenize
            if detokenize and (params.logprobs is not None or params.prompt_logprobs is not None):
                self._name_logprob_tokens(sequence)
            # Final-only requests without stop strings need their text only once, at the end.
            if detokenize and (not sequence.final_only or params.stop or request.status.finished):
                self._detokenize(sequence)
            status = sequence.status = request.status  # a stop string may have ended it just now
            if status.finished:
                self._sequence_ended(request, sequence, now)
            touched[parent.request_id] = parent
        outputs = []
        make_output = self._make_output
        for parent in touched.values():
            sequences = parent.sequences
            finished = sequences[0].status.finished if len(sequences) == 1 else parent.finished
            if finished or not sequences[0].request.sampling_params.final_only:
                outputs.append(make_output(parent, finished))
            if finished:
                self._parents.pop(parent.request_id, None)
        return outputs

    def _emit_deltas(self, updated: list[Request]) -> list[EngineOutput]:
        """`_emit` of a core whose client builds the outputs (deltas=True): one sequence per request and no text
        here, so one pass makes each request's SequenceDelta."""
        outputs: list[EngineOutput] = []
        now = time.monotonic()
        sequence_parent = self._sequence_parent
        make_delta = self._make_delta
        for request in updated:
            parent = sequence_parent.get(request.request_id)
            if parent is None:
                continue
            sequence = parent.sequences[0]
            status = sequence.status = request.status
            if status.finished:
                self._sequence_ended(request, sequence, now)
                self._parents.pop(parent.request_id, None)
                outputs.append(make_delta(parent, True))
            elif sequence.final_only:
                continue
            elif sequence.tokens_only and sequence.num_emitted_tokens:
                # _make_delta's tokens-only form, inline: the delta of nearly every sequence in a decode step.
                tokens = request.output_token_ids
                start = sequence.num_emitted_tokens
                sequence.num_emitted_tokens = len(tokens)
                cached = request.num_cached_tokens
                outputs.append(_new_tuple(SequenceDelta, (parent.request_id, tokens[start:], None, None, None,
                                                          cached if cached > 0 else 0, None, None, None)))
            else:
                outputs.append(make_delta(parent, False))
        return outputs

    def _sequence_ended(self, request: Request, sequence: _Sequence, now: float) -> None:
        """A sequence whose request finished: its matcher released, its end time kept, its id no longer live."""
        if request.sampling_params.structured_outputs is not None and self.structured is not None:
            self.structured.remove(request.request_id)
            self._thinking.pop(request.request_id, None)
        sequence.finished_time = now
        self._sequence_parent.pop(request.request_id, None)

    def _advance_grammars(self, updated: list[Request]) -> None:
        """Feed the step's new tokens to their requests' matchers (one batched call); a grammar complete with its
        stop token ends its request."""
        structured = self.structured
        sequences = []
        new: dict[str, list[int]] = {}
        for request in updated:
            if request.sampling_params.structured_outputs is None:
                continue
            parent = self._sequence_parent.get(request.request_id)
            if parent is None:
                continue
            siblings = parent.sequences
            sequence = siblings[0] if len(siblings) == 1 else next(s for s in siblings if s.request is request)
            sequences.append(sequence)
            tokens = request.output_token_ids[sequence.num_grammar_tokens:]
            if sequence.grammar_state != _GRAMMAR_ON:
                tokens = self._past_thinking(sequence, tokens)
            new[request.request_id] = tokens
        accepted = structured.accept_many(new)
        for sequence in sequences:
            request = sequence.request
            sequence.num_grammar_tokens += accepted[request.request_id]
            if sequence.num_grammar_tokens < request.num_output_tokens and not request.is_finished:
                # A token outside the grammar (its mask applies to every sampled token, so this is a bug).
                logger.warning("request %s: token %d is outside its grammar; the request ends here",
                               request.request_id, request.output_token_ids[sequence.num_grammar_tokens])
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            if not request.is_finished and structured.is_terminated(request.request_id):
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            if request.is_finished:
                structured.remove(request.request_id)

    def _past_thinking(self, sequence: _Sequence, tokens: list[int]) -> list[int]:
        """Of a thinking sequence's new `tokens`, those its grammar reads: the ones after its thinking (those before,
        tags included, count as passed over)."""
        if not tokens:
            return tokens
        tags = sequence.request.sampling_params.structured_outputs.after_thinking
        skipped = 0
        if sequence.grammar_state == _MAY_THINK:
            if tokens[0] == tags.start_token_id:
                sequence.grammar_state, skipped = _THINKING, 1
            else:
                sequence.grammar_state = _GRAMMAR_ON
        if sequence.grammar_state == _THINKING:
            if tags.end_token_id in tokens[skipped:]:
                skipped = tokens.index(tags.end_token_id, skipped) + 1
                sequence.grammar_state = _GRAMMAR_ON
            else:
                skipped = len(tokens)
        if sequence.grammar_state == _GRAMMAR_ON:
            del self._thinking[sequence.request.request_id]
        sequence.num_grammar_tokens += skipped
        return tokens[skipped:]

    def token_text(self, token_id: int) -> str | None:
        """One token's text decoded alone (a logprob's decoded_token); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _name_logprob_tokens(self, sequence: _Sequence) -> None:
        """Give the logprob entries that arrived this step their tokens' text."""
        request = sequence.request
        if len(request.prompt_logprobs) < sequence.num_named_prompt_logprobs:
            sequence.num_named_prompt_logprobs = 0  # preempted: the prompt's logprobs were computed again
        for entries, done in ((request.output_logprobs, sequence.num_named_logprobs),
                              (request.prompt_logprobs, sequence.num_named_prompt_logprobs)):
            for i in range(done, len(entries)):
                if entries[i] is not None:
                    entries[i] = {t: dataclasses.replace(lp, decoded_token=self.token_text(t))
                                  for t, lp in entries[i].items()}
        sequence.num_named_logprobs = len(request.output_logprobs)
        sequence.num_named_prompt_logprobs = len(request.prompt_logprobs)

    def _detokenize(self, sequence: _Sequence) -> None:
        request = sequence.request
        detokenizer = sequence.detokenizer
        new_tokens = request.output_token_ids[len(detokenizer.token_ids):]
        # Stopped by its last token (EOS, a stop token id, a grammar's end): a stop string matches later, here.
        stop_token = request.status == RequestStatus.FINISHED_STOPPED and not isinstance(request.stop_reason, str)
        stop_string = detokenizer.update(new_tokens, stop_token)
        if stop_string is not None and not request.status.finished:
            request.stop_reason = stop_string
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _make_output(self, parent: _ParentRequest, finished: bool) -> RequestOutput:
        sequences = parent.sequences
        first = sequences[0].request
        params = first.sampling_params
        prompt_logprobs = first.prompt_logprobs if params.prompt_logprobs is not None else None
        if sequences[0].delta_outputs:
            # Only the sequences the step advanced or ended, each with only what it added; the prompt's logprobs
            # once, with the first output.
            completions = [_delta_completion(seq) for seq in sequences
                           if seq.num_emitted_tokens < len(seq.request.output_token_ids)
                           or (seq.status.finished and not seq.finish_emitted)]
            if prompt_logprobs is not None:
                # Once, whole: from the first sequence whose prompt has run (siblings prefill apart).
                whole = next((seq.request.prompt_logprobs for seq in sequences
                              if len(seq.request.prompt_logprobs) == len(parent.prompt_token_ids)), None)
                prompt_logprobs = None if parent.prompt_logprobs_emitted else whole
                parent.prompt_logprobs_emitted = parent.prompt_logprobs_emitted or whole is not None
        else:
            completion = self._completion
            completions = ([completion(sequences[0])] if len(sequences) == 1
                           else [completion(seq) for seq in sequences])
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=self._metrics(parent, finished),
            pooled=first.pooled_output,
        )

    @staticmethod
    def _metrics(parent: _ParentRequest, finished: bool) -> RequestMetrics:
        """The request's timestamps and preemptions over its sequences; its finish time once every one ended. The
        metrics handed out last are handed out again while they say what new ones would (they are replaced on
        change, never changed in place)."""
        sequences = parent.sequences
        first = sequences[0].request
        if len(sequences) == 1:
            finished_time = (sequences[0].finished_time or 0.0) if finished else None
            num_preemptions = first.num_preemptions
        else:
            finished_time = max((s.finished_time or 0.0) for s in sequences) if finished else None
            num_preemptions = sum(s.request.num_preemptions for s in sequences)
        last = parent.metrics
        if (last is not None and finished_time is None and last.finished_time is None
                and last.first_token_time == first.first_token_time and last.num_preemptions == num_preemptions
                and last.first_scheduled_time == first.first_scheduled_time):
            return last
        parent.metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            finished_time=finished_time,
            num_preemptions=num_preemptions,
        )
        return parent.metrics

    def _make_delta(self, parent: _ParentRequest, finished: bool) -> SequenceDelta:
        """The tokens the request's one sequence gained since its last delta (`deltas=True`), with its metrics
        when they are news: with its first tokens and at its end."""
        sequence = parent.sequences[0]
        request = sequence.request
        tokens = request.output_token_ids
        start = sequence.num_emitted_tokens
        sequence.num_emitted_tokens = len(tokens)
        cached = request.num_cached_tokens
        # The fields in SequenceDelta's order, through tuple.__new__ (the named tuple's own __new__ is a Python frame
        # more); _emit_deltas builds the tokens-only form itself.
        params = request.sampling_params
        return _new_tuple(SequenceDelta, (
            parent.request_id,
            tokens[start:],
            request.output_logprobs[start:] if params.logprobs is not None else None,
            request.status.finish_reason,
            request.stop_reason,
            cached if cached > 0 else 0,
            request.prompt_logprobs if params.prompt_logprobs is not None else None,
            self._metrics(parent, finished) if finished or not start else None,
            request.pooled_output,
        ))

    @staticmethod
    def _completion(seq: _Sequence) -> CompletionOutput:
        request = seq.request
        output_token_ids = request.output_token_ids
        wants_logprobs = request.sampling_params.logprobs is not None
        start = seq.num_emitted_tokens
        seq.num_emitted_tokens = len(output_token_ids)
        status = seq.status
        detokenizer = seq.detokenizer
        text, delta_text = detokenizer.text_and_delta(status.finished) if detokenizer is not None else ("", "")
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(output_token_ids),
            logprobs=list(request.output_logprobs) if wants_logprobs else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            delta_text=delta_text,
            delta_token_ids=output_token_ids[start:],
            delta_logprobs=request.output_logprobs[start:] if wants_logprobs else None,
        )


def _delta_completion(seq: _Sequence) -> CompletionOutput:
    request = seq.request
    start = seq.num_emitted_tokens
    seq.num_emitted_tokens = len(request.output_token_ids)
    status = seq.status
    seq.finish_emitted = status.finished
    detokenizer = seq.detokenizer
    out = delta_completion(seq.index, request.output_token_ids,
                           request.output_logprobs if request.sampling_params.logprobs is not None else None, start,
                           detokenizer.get_delta(status.finished) if detokenizer is not None else "",
                           status.finish_reason, request.stop_reason, seq.logprob_sum)
    seq.logprob_sum = out.logprob_sum or 0.0
    return out
