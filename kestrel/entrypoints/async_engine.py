"""AsyncEngine: the EngineCore loop in a background thread, streamed to asyncio callers.

Only the engine thread touches the EngineCore. Callers submit commands (add, abort) to a list
guarded by a condition variable; the thread drains it between steps and sleeps on the condition
when it has nothing to do. Outputs travel back to each request's stream through
`loop.call_soon_threadsafe`, one call per step and event loop. Outputs a slow reader has not
taken yet are merged (their deltas joined), so a stalled client holds one output, not thousands.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kestrel.config import EngineConfig, GenerationDefaults
from kestrel.engine.core import EngineCore
from kestrel.engine.stats_logger import StatsLogger
from kestrel.entrypoints.engine_stats import ITERATION_TOKEN_BUCKETS, EngineStats, StatsTracker  # noqa: F401 - re-exported
from kestrel.entrypoints.media import MediaProcessor
from kestrel.outputs import CompletionOutput, RequestOutput
from kestrel.pooling_params import PoolingParams
from kestrel.request import InvalidRequestError, MediaItem
from kestrel.sampling_params import SamplingParams

DEFAULT_RETRY_AFTER_S = 1
SHUTTING_DOWN_MESSAGE = ("the server is shutting down and takes no new requests; retry on another replica or after "
                         "it restarts")
# What clients are told of an engine failure; the error itself (it may name worker processes, files, devices)
# goes to the server log.
ENGINE_FAILED_MESSAGE = "the engine stopped after an error (see the server log); no request can be served"
logger = logging.getLogger("kestrel.engine")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crashed or shut down); no request can be served any more."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerShuttingDownError(RuntimeError):
    """The server is draining before it stops: no new requests, and the unfinished ones end at the deadline."""


class RequestTimeoutError(TimeoutError):
    """A request ran past its deadline and was aborted."""


_ACCEPTED = object()  # first queue item of a request the engine took


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    prompt: str | None
    priority: int = 0
    grammar: Any = None  # the compiled grammar of params.structured_outputs (the server compiles it)
    media: tuple[MediaItem, ...] = ()  # the prompt's images, their placeholders expanded (entrypoints.media)
    cache_salt: str | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _ResetPrefixCache:
    done: concurrent.futures.Future  # its result: whether the cache was reset (only while no request holds a block)


def check_queue_room(queued: int, num_sequences: int, free_slots: int, limit: int) -> None:
    """Raise QueueFullError if `num_sequences` more would leave more than `limit` sequences waiting: `queued` are
    accepted and not yet running, and the `free_slots` of the running batch take that many of them first."""
    waiting = queued + num_sequences - max(0, free_slots)
    if waiting > limit:
        raise QueueFullError(f"the queue is full: {max(0, waiting - num_sequences)} sequences would wait beside "
                             f"the {num_sequences} of this request (limit max_queued_requests={limit}, sequences "
                             "waiting for a place in the running batch); retry later")


class RequestIdInUseError(ValueError):
    """A request submitted under the id of one still running (or whose abort the engine has not applied yet)."""


class RequestStream:
    """The outputs of one request, in order; `aclose()` (or leaving an `async for` early) aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, deadline: float | None, delta: bool = False) -> None:
        self.request_id = request_id
        self._delta = delta  # output_kind="delta": outputs waiting to be read merge by joining their deltas
        self.loop = asyncio.get_running_loop()
        self._items: deque[Any] = deque()
        self._ready = asyncio.Event()
        self.finished = False
        self._engine = engine
        self._deadline = deadline
        self._accepted = False

    async def accepted(self) -> None:
        """Wait until the engine took the request; raise its validation error if it refused it."""
        if self._accepted:
            return
        await self._next_item()
        self._accepted = True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self.accepted()
        item = await self._next_item()
        if item.finished:
            self.finished = True
        return item

    async def _next_item(self) -> Any:
        """The next item from the engine; a cancelled wait aborts the request, an engine error is raised."""
        try:
            item = await self._get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    async def _get(self) -> Any:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns an item that arrives in the turn the reader
        # is cancelled (its client went away) and swallows the cancellation, so the request would run on.
        while not self._items:
            self._ready.clear()
            remaining = None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)
            try:
                async with asyncio.timeout(remaining):
                    await self._ready.wait()
            except TimeoutError:
                raise self._timed_out() from None
        item = self._items[0]
        # A reader slower than the engine always finds an item waiting: the deadline is checked here too, short
        # of the request's last output.
        if (self._deadline is not None and time.monotonic() > self._deadline and isinstance(item, RequestOutput)
                and not item.finished):
            raise self._timed_out()
        return self._items.popleft()

    def _timed_out(self) -> RequestTimeoutError:
        return RequestTimeoutError(f"request {self.request_id} ran past its timeout and was aborted")

    def put(self, item: Any) -> None:
        """Called on the stream's event loop by the engine thread's delivery."""
        if self._items and isinstance(item, RequestOutput) and isinstance(self._items[-1], RequestOutput):
            self._items[-1] = merge_outputs(self._items[-1], item, self._delta)
        else:
            self._items.append(item)
        self._ready.set()

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs an EngineCore in a daemon thread; `generate` streams a request's outputs to asyncio."""

    # The server hands this engine its requests' grammars compiled (an engine core in its own process compiles them
    # itself, from their source).
    compiles_grammars = False

    def __init__(self, core: EngineCore, tokenizer: Any, *, model_path: str = "",
                 max_queued_requests: int | None = None, request_timeout_s: float | None = None) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0 or None, got {max_queued_requests}")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s}")
        self.core = core
        self.tokenizer = tokenizer
        self.model_path = model_path
        # A multimodal model's processor (images -> media items); None: the model takes text only.
        self.media: MediaProcessor | None = None
        # The server's prompt compressor (`prompt_compressor`); the engine takes prompts compressed already.
        self.prompt_compressor: Any = None
        self.max_model_len: int = core.max_model_len
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _ResetPrefixCache] = []
        # Aborted ids whose abort the engine thread has not applied: a step in flight may still answer for them,
        # so a new request may not take the id before then.
        self._aborting: set[str] = set()
        self._streams: dict[str, RequestStream] = {}
        self._num_pending_sequences = 0  # submitted, not yet handed to the scheduler
        self._stats = EngineStats()
        self._stopping = False
        self._failed: EngineDeadError | None = None  # what every request got when the engine stopped
        self._draining = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kestrel-engine", daemon=True)
        self._stats_logger = None if core.config.disable_log_stats else StatsLogger()
        self._stats_tracker = StatsTracker()

    @classmethod
    def from_args(cls, model: str, *, max_queued_requests: int | None = None,
                  request_timeout_s: float | None = None, **engine_args: Any) -> AsyncEngine:
        """Load the model as `LLM(model, **engine_args)` does, and wrap its engine."""
        from kestrel.entrypoints.engine_factory import engine_config

        return cls.from_config(engine_config(model, **engine_args), model, max_queued_requests=max_queued_requests,
                               request_timeout_s=request_timeout_s)

    @classmethod
    def from_config(cls, config: EngineConfig, model: str, *, max_queued_requests: int | None = None,
                    request_timeout_s: float | None = None) -> AsyncEngine:
        """`from_args` on a config already read (`engine_factory.engine_config`) of the model at `model`."""
        from kestrel.entrypoints.engine_factory import build_engine
        from kestrel.entrypoints.prompt_compression import build_prompt_compressor

        compressor = build_prompt_compressor(config)  # first: the served model's memory plan then counts it
        built = build_engine(config)
        engine = cls(built.core, built.tokenizer, model_path=model, max_queued_requests=max_queued_requests,
                     request_timeout_s=request_timeout_s)
        engine.prompt_compressor = compressor
        engine.media = built.media
        return engine

    # ----- life cycle -----------------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        stop_workers = getattr(self.core.runner, "shutdown", None)
        if stop_workers is not None:  # an executor's worker processes
            stop_workers()

    def begin_drain(self) -> None:
        """Refuse new requests (ServerShuttingDownError); the running ones go on until `end_unfinished`."""
        with self._cond:
            self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_unfinished(self) -> int:
        # Without the lock (a dict's length is read whole): the server's signal handler asks, on the thread that
        # may be holding it.
        return len(self._streams)

    def end_unfinished(self, reason: str) -> int:
        """Abort every unfinished request and end its stream with ServerShuttingDownError(reason); how many."""
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
            self._commands.extend(_Abort(stream.request_id) for stream in streams)
            self._aborting.update(stream.request_id for stream in streams)
            self._cond.notify()
        self._deliver([(stream, ServerShuttingDownError(reason)) for stream in streams])
        return len(streams)

    @property
    def is_healthy(self) -> bool:
        # An executor whose worker died is unhealthy at once, before any step runs into it.
        runner_ok = getattr(self.core.runner, "healthy", True)
        return (self._error is None and not self._stopping and not self._draining and self._thread.is_alive()
                and runner_ok)

    @property
    def error(self) -> BaseException | None:
        return self._error or getattr(self.core.runner, "error", None)

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return self.core.generation_defaults

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.eos_token_ids

    @property
    def tokenizer_path(self) -> str:
        return self.core.config.model.tokenizer_path

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.core.runner, "vocab_size", None)

    def stats(self) -> EngineStats:
        return self._stats

    # ----- submission (event-loop side) -------------------------------------------------------------

    @property
    def max_sequences_per_request(self) -> int | None:
        """The most sequences one request may ask for: with more, it could never be admitted."""
        if self.max_queued_requests is None:
            return None
        return self.max_queued_requests + self.core.config.scheduler.max_num_seqs

    def check_capacity(self, num_sequences: int = 1) -> None:
        """Raise QueueFullError if `num_sequences` more waiting sequences would exceed the queue limit."""
        self._check_alive()
        if self.max_queued_requests is None:
            return
        with self._cond:
            stats = self._stats
            queued = self._num_pending_sequences + stats.num_waiting
        check_queue_room(queued, num_sequences, self.core.config.scheduler.max_num_seqs - stats.num_running,
                         self.max_queued_requests)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
               prompt: str | None = None, timeout_s: float | None = None, priority: int = 0,
               grammar: Any = None, media: tuple[MediaItem, ...] = (), cache_salt: str | None = None) -> RequestStream:
        """Queue a request without waiting; the stream raises the engine's refusal, if any, when read. `grammar`:
        params.structured_outputs compiled (the grammar backend's object), so the engine thread does not compile.
        `media`: the prompt's images as the media processor (`self.media`) made them. `cache_salt`: see
        `EngineCore.add_request`."""
        self._check_alive()
        if getattr(params, "prompt_compression", None) is not None:
            raise InvalidRequestError("prompt_compression", "the engine takes prompts already compressed; "
                                      "prompt_compression is done by the server's endpoints and by LLM")
        timeout_s = timeout_s if timeout_s is not None else self.request_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stream = RequestStream(self, request_id, deadline,
                               delta=isinstance(params, SamplingParams) and params.delta_outputs)
        with self._cond:
            if self._failed is not None:
                raise EngineDeadError(str(self._failed))
            if request_id in self._aborting:
                raise RequestIdInUseError(f"request id {request_id!r} is still in use: its abort takes effect "
                                          "before the engine's next step; retry then, or use another id")
            if request_id in self._streams:
                raise RequestIdInUseError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._commands.append(_Add(request_id, list(prompt_token_ids), params, prompt, priority, grammar,
                                       tuple(media), cache_salt))
            self._num_pending_sequences += params.n
            self._cond.notify()
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, timeout_s: float | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative text and token ids, plus per-step deltas)."""
        stream = self.submit(request_id, prompt_token_ids, params, prompt, timeout_s, priority)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks are freed before the engine's next step, and a reader still iterating
        its stream gets its final output (finish_reason "abort", with what it generated so far)."""
        with self._cond:
            if request_id not in self._streams or request_id in self._aborting:
                return
            self._commands.append(_Abort(request_id))
            self._aborting.add(request_id)
            self._cond.notify()

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Forget every cached prompt prefix before the engine's next step; the future's result says whether it was
        (only while no request holds a block, as `LLM.reset_prefix_cache`)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._check_alive()
            if self._failed is not None:
                raise EngineDeadError(str(self._failed))
            self._commands.append(_ResetPrefixCache(done))
            self._cond.notify()
        return done

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(ENGINE_FAILED_MESSAGE)
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        if self._draining:
            raise ServerShuttingDownError(SHUTTING_DOWN_MESSAGE)

    # ----- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._stats_logger is not None and not self.core.has_unfinished_requests():
                    self._stats_logger.maybe_log(self.core.scheduler, force=True)  # the last line of a busy spell
                with self._cond:
                    while not (self._commands or self._stopping or self.core.has_unfinished_requests()
                               or self.core.has_idle_work):
                        self._cond.wait()
                    if self._stopping:
                        break
                    # Applied under the lock so the queue length seen by check_capacity never drops a request.
                    replies = self._apply(self._commands)
                    self._commands = []
                    self._num_pending_sequences = 0
                    # Stats first: a caller woken by its output must see the state that produced it.
                    self._publish_stats()
                    self._deliver(replies)
                if not self.core.has_unfinished_requests():
                    self.core.do_idle_work()  # one pending CUDA graph, then the commands are looked at again
                    continue
                outputs = self.core.step()
                self._stats_tracker.count_step(self.core.scheduler)
                if self._stats_logger is not None:
                    self._stats_logger.maybe_log(self.core.scheduler)
                with self._cond:
                    self._publish_stats()
                    self._dispatch(outputs)
        except BaseException as error:
            self._error = error
            logger.exception("the engine thread stopped after an error; every request fails from now on")
            self._fail_all(EngineDeadError(ENGINE_FAILED_MESSAGE))
            return
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _apply(self, commands: list[_Add | _Abort | _ResetPrefixCache]) -> list[tuple[RequestStream, Any]]:
        """Run the callers' commands; return each added request's reply (accepted, or its refusal)."""
        accepted: list[tuple[RequestStream, Any]] = []
        for command in commands:
            if isinstance(command, _ResetPrefixCache):
                command.done.set_result(self.core.reset_prefix_cache())
                continue
            if isinstance(command, _Abort):
                finals = self.core.abort_request([command.request_id])
                self._aborting.discard(command.request_id)
                stream = self._streams.pop(command.request_id, None)
                if stream is not None and finals:
                    accepted.append((stream, finals[0]))
                continue
            stream = self._streams.get(command.request_id)
            if stream is None:
                continue  # aborted before the engine saw it
            try:
                self.core.add_request(command.request_id, command.prompt_token_ids, command.params, command.prompt,
                                      command.priority, command.grammar, command.media, command.cache_salt)
            except ValueError as refusal:  # InvalidRequestError and friends: this request only
                del self._streams[command.request_id]
                accepted.append((stream, refusal))
                continue
            accepted.append((stream, _ACCEPTED))
        return accepted

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        items = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            items.append((stream, output))
        self._deliver(items)

    def _deliver(self, items: list[tuple[RequestStream, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            # A closed event loop raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, batch)

    def _publish_stats(self) -> None:
        self._stats = self._stats_tracker.snapshot(self.core.scheduler)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._cond:
            self._failed = error  # a submit that passed _check_alive meanwhile finds it under the lock
            streams = list(self._streams.values())
            self._streams.clear()
            for command in self._commands:
                if isinstance(command, _ResetPrefixCache):
                    command.done.set_exception(error)
            self._commands = []
            self._aborting.clear()
            self._num_pending_sequences = 0
        self._deliver([(stream, error) for stream in streams])


def submit_all(engine: Any, requests: list[tuple[str, list[int], dict[str, Any]]]) -> list[RequestStream]:
    """`engine.submit(request_id, prompt_token_ids, **rest)` for each request, all or none: one refused (the drain
    began, the engine stopped) aborts those submitted before it, then is raised. AsyncEngine or CoreClient."""
    streams: list[RequestStream] = []
    try:
        for request_id, prompt_token_ids, rest in requests:
            streams.append(engine.submit(request_id, prompt_token_ids, **rest))
    except BaseException:
        for stream in streams:
            stream.finished = True
            engine.abort(stream.request_id)
        raise
    return streams


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream.put(item)


def merge_outputs(earlier: RequestOutput, later: RequestOutput, delta: bool = False) -> RequestOutput:
    """One output equivalent to reading `earlier` then `later`: the later state with both deltas. `delta`: the
    outputs are output_kind="delta" ones (text, token ids and logprobs are deltas too, and a sequence appears only
    where it changed)."""
    before = {c.index: c for c in earlier.outputs}
    merged = []
    for c in later.outputs:
        old = before.pop(c.index, None)
        if old is None:
            merged.append(c)
            continue
        logprobs = None
        if old.delta_logprobs is not None or c.delta_logprobs is not None:
            logprobs = (old.delta_logprobs or []) + (c.delta_logprobs or [])
        joined = dict(delta_text=old.delta_text + c.delta_text, delta_token_ids=old.delta_token_ids + c.delta_token_ids,
                      delta_logprobs=logprobs)
        if delta:
            joined.update(text=joined["delta_text"], token_ids=joined["delta_token_ids"], logprobs=logprobs)
        merged.append(dataclasses.replace(c, **joined))
    if not delta:
        return dataclasses.replace(later, outputs=merged)
    # A sequence that changed only in the earlier output keeps its delta.
    merged = sorted([*merged, *before.values()], key=lambda c: c.index)
    return dataclasses.replace(later, outputs=merged, prompt_logprobs=(
        earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs))


class DeltaJoiner:
    """A request's output_kind="delta" outputs joined as they come into the output a cumulative request ends with
    (each sequence's text, token ids and logprobs whole; the prompt's logprobs from the first output): what a
    caller that needs only the end gets without the engine copying every output whole at every step."""

    def __init__(self) -> None:
        self._texts: dict[int, list[str]] = {}
        self._token_ids: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[Any]] = {}
        self._last: dict[int, CompletionOutput] = {}
        self._output: RequestOutput | None = None
        self._prompt_logprobs: Any = None

    def add(self, output: RequestOutput) -> None:
        for c in output.outputs:
            self._texts.setdefault(c.index, []).append(c.text)
            self._token_ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                self._logprobs.setdefault(c.index, []).extend(c.logprobs)
            self._last[c.index] = c
        if self._prompt_logprobs is None:
            self._prompt_logprobs = output.prompt_logprobs
        self._output = output

    def joined(self) -> RequestOutput | None:
        """The cumulative output so far (None before the first)."""
        if self._output is None:
            return None
        completions = []
        for index in sorted(self._last):
            last = self._last[index]
            text = "".join(self._texts[index])
            logprobs = self._logprobs.get(index, []) if last.logprobs is not None else None
            completions.append(dataclasses.replace(
                last, text=text, token_ids=self._token_ids[index], logprobs=logprobs, delta_text=text,
                delta_token_ids=self._token_ids[index], delta_logprobs=logprobs))
        return dataclasses.replace(self._output, outputs=completions, prompt_logprobs=self._prompt_logprobs)
