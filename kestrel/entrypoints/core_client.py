"""CoreClient: the server's engine when the engine core runs in its own process (`--engine-core-process`).

It offers what the server uses of AsyncEngine (submit, abort, stats, health, drain), over a spawned core process
(kestrel.entrypoints.core_process). Requests go to the core as they are submitted; a reader thread takes each
step's token ids, detokenizes them (kestrel.entrypoints.core_outputs) and hands the outputs to the requests'
streams, so the core's loop never runs tokenizer code and never waits on this process.

A core that dies or fails (killed, out of memory, a step's error) fails every request in flight and every later
one with EngineDeadError, and /health turns 503. The core never outlives this process: it exits when its pipe
closes and the kernel kills it when this process dies; `shutdown` stops it and reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import wait
from typing import Any

from kestrel.config import ConfigError, EngineConfig, GenerationDefaults
from kestrel.engine.core import bad_word_sequences
from kestrel.entrypoints.async_engine import (
    _ACCEPTED,
    SHUTTING_DOWN_MESSAGE,
    EngineDeadError,
    RequestIdInUseError,
    RequestStream,
    ServerShuttingDownError,
    _put_all,
    check_queue_room,
)
from kestrel.entrypoints.core_outputs import ClientRequest, child_id, child_params
from kestrel.entrypoints.core_process import CoreProcessSpec, build_model_core, core_process_main
from kestrel.entrypoints.core_protocol import (
    ABORT,
    ADD,
    ERROR,
    READY,
    SHUTDOWN,
    START,
    STEP,
    TOKENIZER_INFO,
    delta_from_wire,
    pack,
    params_to_wire,
    refusal_from_wire,
    startup_error_from_wire,
    unpack,
)
from kestrel.entrypoints.engine_factory import model_modalities
from kestrel.entrypoints.engine_stats import EngineStats
from kestrel.entrypoints.media import media_processor
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.outputs import RequestOutput
from kestrel.pooling_params import PoolingParams
from kestrel.sampling_params import SamplingParams
from kestrel.structured.backend import GrammarBackend
from kestrel.structured.compile import GrammarSource

logger = logging.getLogger("kestrel.engine")
# What clients are told; the cause (exit code, the core's error) goes to the server log.
CORE_FAILED_MESSAGE = ("the engine core process stopped (see the server log); this request and every later one "
                       "fail until the server is restarted")


@dataclass(frozen=True)
class CoreRunnerInfo:
    """What the server reports of the core's model runner (startup summary)."""

    dtype: str
    device: str
    capture_seconds: float | None
    vocab_size: int
    graphs_pending: bool  # graph_capture="serving": the core captures them once it serves


class CoreView:
    """The engine facts the server reads from `engine.core` (config, KV blocks, grammar vocabulary, token texts),
    held in this process."""

    def __init__(self, config: EngineConfig, tokenizer: Any, info: dict[str, Any]) -> None:
        self.config = config
        self.num_blocks: int = info["num_blocks"]
        self.runner = CoreRunnerInfo(info["dtype"], info["device"], info["capture_seconds"], info["vocab_size"],
                                     info["graphs_pending"])
        # The grammar pool compiles its trial grammars against the core's vocabulary, read here.
        self.structured = GrammarBackend(tokenizer, info["vocab_size"], frozenset(info["eos_token_ids"]))
        self._tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str | None:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class CoreClient:
    compiles_grammars = True  # the server hands over each grammar's source (see GrammarCompilePool)

    def __init__(self, config: EngineConfig, *, model_path: str = "", max_queued_requests: int | None = None,
                 request_timeout_s: float | None = None, log_level: int | str = "WARNING",
                 build_core: Callable[[EngineConfig, int | None], Any] = build_model_core) -> None:
        """`build_core`: how the core process builds its engine core (core_process.CoreProcessSpec.build)."""
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0 or None, got {max_queued_requests}")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s}")
        self.config = config
        self.prompt_compressor: Any = None  # the server's prompt compressor (from_args builds it)
        self.model_path = model_path
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        ctx = get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: the core may start worker processes of its own (an executor).
        self._process = ctx.Process(target=core_process_main, name="kestrel-engine-core",
                                    args=(CoreProcessSpec(config, os.getpid(), log_level, build_core), child))
        self._process.start()
        child.close()
        try:
            self.tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.trust_remote_code)
            eos = self.tokenizer.eos_token_id
            self._conn.send_bytes(pack([START, eos]))
            info = self._wait_ready()
        except BaseException:
            self._reap(0.0)
            self._conn.close()
            raise
        self.max_model_len: int = config.model.max_model_len or 0
        self.generation_defaults: GenerationDefaults = config.model.generation_defaults
        self.eos_token_ids = frozenset(self.generation_defaults.eos_token_ids | ({eos} - {None}))
        self.core = CoreView(config, self.tokenizer, info)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._requests: dict[str, ClientRequest] = {}
        self._child_parent: dict[str, str] = {}
        self._unaccepted: set[str] = set()  # requests none of whose sequences the core has taken yet
        self._vocabulary_sent = False
        self._num_pending_sequences = 0
        self._stats = EngineStats()
        self._error: str | None = None
        self._stopping = False
        self._failed: EngineDeadError | None = None  # what every request got when the engine stopped
        self._aborting: dict[str, str] = {}  # sequence id -> its request's id, while the core has not applied the abort
        # Requests aborted by their id whose reader gets a final output once the core has applied the abort: request
        # id -> (stream, request, whether the core had taken it yet).
        self._closing: dict[str, tuple[RequestStream, ClientRequest, bool]] = {}
        self._draining = False
        self._reader = threading.Thread(target=self._run, name="kestrel-core-client", daemon=True)
        # Messages to the core go out from a thread of their own, in order: a core that stops reading (alive but
        # stuck) fills the pipe, and only that thread then waits, not the server's event loop.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="kestrel-core-client-writer", daemon=True)

    @classmethod
    def from_args(cls, model: str, *, max_queued_requests: int | None = None, request_timeout_s: float | None = None,
                  log_level: int | str = "WARNING", **engine_args: Any) -> CoreClient:
        """The engine of `kestrel serve --engine-core-process`: the config as `LLM(model, **engine_args)` reads it,
        the model loaded in the core process."""
        from kestrel.entrypoints.engine_factory import engine_config

        return cls.from_config(engine_config(model, **engine_args), model, max_queued_requests=max_queued_requests,
                               request_timeout_s=request_timeout_s, log_level=log_level)

    @classmethod
    def from_config(cls, config: EngineConfig, model: str, *, max_queued_requests: int | None = None,
                    request_timeout_s: float | None = None, log_level: int | str = "WARNING") -> CoreClient:
        """`from_args` on a config already read (`engine_factory.engine_config`) of the model at `model`."""
        from kestrel.entrypoints.prompt_compression import build_prompt_compressor

        if model_modalities(config):
            raise ConfigError("the engine core in its own process serves text models; serve this multimodal model "
                              "with --no-engine-core-process")
        media_processor(config.model, frozenset(), None)  # a text model's media settings are refused, by name
        # The compressor runs in this (the API) process, loaded before the core's memory plan measures the device.
        compressor = build_prompt_compressor(config)
        client = cls(config, model_path=model, max_queued_requests=max_queued_requests,
                     request_timeout_s=request_timeout_s, log_level=log_level)
        client.prompt_compressor = compressor
        return client

    @property
    def pid(self) -> int | None:
        """The core process's id."""
        return self._process.pid

    def _wait_ready(self) -> dict[str, Any]:
        while True:
            ready = wait([self._conn, self._process.sentinel])
            if self._conn in ready:
                try:
                    message = unpack(self._conn.recv_bytes())
                except (EOFError, OSError):
                    message = None
                if message is not None and message[0] == READY:
                    return message[1]
                if message is not None and message[0] == ERROR:
                    raise startup_error_from_wire(message[1])
            if self._process.sentinel in ready or not self._process.is_alive():
                self._process.join(5.0)
                raise RuntimeError(f"the engine core process (pid {self._process.pid}) exited with code "
                                   f"{self._process.exitcode} while starting; see the log above")

    # ----- life cycle -----------------------------------------------------------------------------------

    def start(self) -> CoreClient:
        self._reader.start()
        self._writer.start()
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core process (its in-flight requests end with EngineDeadError) and reap it."""
        self._stopping = True
        self._send([SHUTDOWN])
        self._outbox.put(None)
        self._reap(timeout_s)
        for thread in (self._writer, self._reader):  # they end at the pipe's EOF (or error), the core being gone
            if thread.is_alive():
                thread.join(timeout_s)
        if not (self._reader.is_alive() or self._writer.is_alive()):  # closed under either, the pipe's number
            with self._send_lock:                                       # could go to another file
                self._conn.close()
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _reap(self, timeout_s: float) -> None:
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)

    def begin_drain(self) -> None:
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
        with self._lock:
            streams = list(self._streams.values())
            children = [(c, s.request_id) for s in streams for c in self._forget(s.request_id)]
        self._send_abort(children)
        _deliver([(stream, ServerShuttingDownError(reason)) for stream in streams])
        return len(streams)

    @property
    def is_healthy(self) -> bool:
        return (self._error is None and not self._stopping and not self._draining and self._process.is_alive()
                and self._reader.is_alive())

    @property
    def error(self) -> BaseException | None:
        return None if self._error is None else EngineDeadError(self._error)

    @property
    def tokenizer_path(self) -> str:
        return self.config.model.tokenizer_path

    @property
    def vocab_size(self) -> int | None:
        return self.core.runner.vocab_size

    def stats(self) -> EngineStats:
        return self._stats

    # ----- submission (event-loop side) ---------------------------------------------------------------

    @property
    def max_sequences_per_request(self) -> int | None:
        if self.max_queued_requests is None:
            return None
        return self.max_queued_requests + self.config.scheduler.max_num_seqs

    def check_capacity(self, num_sequences: int = 1) -> None:
        self._check_alive()
        if self.max_queued_requests is None:
            return
        stats = self._stats
        queued = self._num_pending_sequences + stats.num_waiting
        check_queue_room(queued, num_sequences, self.config.scheduler.max_num_seqs - stats.num_running,
                         self.max_queued_requests)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
               prompt: str | None = None, timeout_s: float | None = None, priority: int = 0,
               grammar: GrammarSource | None = None, cache_salt: str | None = None) -> RequestStream:
        """Send the request's sequences to the core without waiting; the stream raises the core's refusal, if any,
        when read. `grammar`: the source of params.structured_outputs (the grammar pool proved it compiles); the
        core compiles it off its loop. `cache_salt`: see `EngineCore.add_request`."""
        if grammar is not None and not isinstance(grammar, GrammarSource):
            raise TypeError(f"the engine core process compiles grammars itself and takes their GrammarSource, got "
                            f"{type(grammar).__name__}")
        self._check_alive()
        if isinstance(params, SamplingParams) and params.bad_words and params.bad_words_token_ids is None:
            params = params.replace(bad_words_token_ids=bad_word_sequences(self.tokenizer, params.bad_words))
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            self._send_vocabulary()
        timeout_s = timeout_s if timeout_s is not None else self.request_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stream = RequestStream(self, request_id, deadline,
                               delta=isinstance(params, SamplingParams) and params.delta_outputs)
        prompt_token_ids = list(prompt_token_ids)
        request = ClientRequest(request_id, prompt, prompt_token_ids, params, self.tokenizer, self.core.token_text)
        grammar_wire = None if grammar is None else [grammar.kind, grammar.text, grammar.any_whitespace]
        messages = []
        with self._lock:
            if self._failed is not None:
                raise EngineDeadError(str(self._failed))
            if request_id in self._streams:
                raise RequestIdInUseError(f"request id {request_id!r} is already in use")
            if request_id in self._aborting.values():
                raise RequestIdInUseError(f"request id {request_id!r} is still in use: its abort takes effect in "
                                          "the engine core's next step; retry then, or use another id")
            self._streams[request_id] = stream
            self._requests[request_id] = request
            self._unaccepted.add(request_id)
            for index, sequence_params in child_params(params):
                cid = child_id(request_id, index, params.n)
                self._child_parent[cid] = request_id
                messages.append([ADD, cid, prompt_token_ids, params_to_wire(sequence_params), priority, grammar_wire,
                                 cache_salt])
            self._num_pending_sequences += params.n
        for message in messages:
            self._send(message)
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, timeout_s: float | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        stream = self.submit(request_id, prompt_token_ids, params, prompt, timeout_s, priority)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Stop a request; a reader still iterating its stream gets its final output (finish_reason "abort", with
        what it generated so far) once the core has applied the abort."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return
            request = self._requests.get(request_id)
            if request is not None and not self._stopping:
                self._closing[request_id] = (stream, request, request_id not in self._unaccepted)
            children = [(cid, request_id) for cid in self._forget(request_id)]
        self._send_abort(children)

    def _forget(self, request_id: str) -> list[str]:
        """Drop a request's state (under the lock); its sequences' ids, for the core's abort."""
        self._streams.pop(request_id, None)
        request = self._requests.pop(request_id, None)
        if request_id in self._unaccepted:
            self._unaccepted.discard(request_id)
            self._num_pending_sequences -= request.params.n if request is not None else 0
        children = list(request.sequences) if request is not None else []
        for cid in children:
            self._child_parent.pop(cid, None)
        return children

    def _send_vocabulary(self) -> None:
        with self._lock:
            if self._vocabulary_sent:
                return
            self._vocabulary_sent = True
        self._send([TOKENIZER_INFO, self.core.structured.tokenizer_info.serialize_json()])

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(CORE_FAILED_MESSAGE)
        if self._stopping:
            raise EngineDeadError("the engine is not running")
        if self._draining:
            raise ServerShuttingDownError(SHUTTING_DOWN_MESSAGE)

    def _send(self, message: list[Any]) -> None:
        payload = pack(message)
        if self._writer.is_alive():
            self._outbox.put(payload)
        else:  # not started (a client that only checks its start-up), or stopped: this thread sends
            self._write_now(payload)

    def _write(self) -> None:
        while (payload := self._outbox.get()) is not None:
            self._write_now(payload)

    def _write_now(self, payload: bytes) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(payload)
        except (OSError, ValueError):  # the core is gone (a closed pipe); the reader reports it
            if not self._stopping:
                logger.debug("a message to the engine core process was not delivered")

    def _send_abort(self, children: list[tuple[str, str]]) -> None:
        """Abort sequences in the core: (sequence id, its request's id) pairs. Until the core says it applied the
        abort (a later STEP lists the ids), a step in flight may still carry those sequences, so a new request may
        not take their request's id."""
        if not children or self._stopping:
            return
        with self._lock:
            self._aborting.update(children)
        self._send([ABORT, [cid for cid, _ in children]])

    # ----- the reader thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        reason = None
        try:
            while reason is None:
                ready = wait([self._conn, self._process.sentinel])
                if self._conn in ready:
                    try:
                        message = unpack(self._conn.recv_bytes())
                    except (EOFError, OSError):
                        reason = self._exit_reason()
                        break
                    if message[0] == STEP:
                        self._on_step(*message[1:])
                    elif message[0] == ERROR:
                        name, text = message[1][0], message[1][1]
                        reason = f"the engine core process failed: {name}: {text}"
                elif self._process.sentinel in ready:
                    reason = self._exit_reason()
        except Exception as error:  # noqa: BLE001 - a bug here must still fail the requests, not hang them
            logger.exception("the engine core client stopped after an error")
            reason = f"the engine core client failed: {type(error).__name__}: {error}"
        if self._stopping:
            return
        self._error = reason
        logger.error("%s; every request fails from now on", reason)
        self._fail_all(EngineDeadError(CORE_FAILED_MESSAGE))

    def _exit_reason(self) -> str:
        self._process.join(1.0)
        return f"the engine core process (pid {self._process.pid}) exited with code {self._process.exitcode}"

    def _on_step(self, accepted: list[str], refused: list[list[Any]], records: list[list[Any]],
                 stats: list[Any], aborted: list[str]) -> None:
        items: list[tuple[RequestStream, Any]] = []
        aborts: list[tuple[str, str]] = []
        touched: dict[str, ClientRequest] = {}
        with self._lock:
            self._stats = EngineStats.from_wire(stats)
            for cid in accepted:
                parent = self._child_parent.get(cid)
                if parent is not None and parent in self._unaccepted:  # a request is taken with its first sequence
                    self._unaccepted.discard(parent)
                    self._num_pending_sequences -= self._requests[parent].params.n
                    items.append((self._streams[parent], _ACCEPTED))
            for cid, error in refused:
                parent = self._child_parent.get(cid)
                if parent is not None:
                    stream = self._streams[parent]
                    aborts += [(c, parent) for c in self._forget(parent) if c != cid]
                    items.append((stream, refusal_from_wire(error)))
            requests = [(delta_from_wire(r), self._request_of(r[0])) for r in records]
        # Detokenizing runs outside the lock: only this thread touches a request's sequences.
        for delta, request in requests:
            if request is None:
                continue  # aborted meanwhile
            if request.apply(delta):
                aborts.append((delta.request_id, request.request_id))
            touched[request.request_id] = request
        outputs = [(request, request.output()) for request in touched.values()]
        with self._lock:
            for request, output in outputs:
                stream = self._streams.get(request.request_id)
                if stream is None and request.request_id in self._closing:
                    # Aborted by its id (meanwhile, or the core's last delta of it): its reader still reads.
                    stream, _, accepted = self._closing[request.request_id]
                    if not accepted:
                        items.append((stream, _ACCEPTED))
                        self._closing[request.request_id] = (stream, request, True)
                    if output is not None and output.finished:
                        del self._closing[request.request_id]
                elif stream is not None and output is not None and output.finished:
                    self._forget(request.request_id)
                if output is not None and stream is not None:
                    items.append((stream, output))
            closing = []
            for cid in aborted:  # this step came after the core applied these aborts: no later one names them
                parent = self._aborting.pop(cid, None)
                if parent is not None and parent in self._closing:
                    closing.append(self._closing.pop(parent))
        for stream, request, accepted in closing:  # the core had none of it: the final output is made here
            final = request.aborted()
            items += ([] if accepted else [(stream, _ACCEPTED)]) + ([(stream, final)] if final is not None else [])
        self._send_abort(aborts)
        _deliver(items)

    def _request_of(self, sequence_id: str) -> ClientRequest | None:
        """(Under the lock) the request a sequence's delta belongs to: a live one, or one aborted by its id whose
        reader waits for its final output (the core's last delta of the sequence, finish_reason "abort")."""
        request = self._requests.get(self._child_parent.get(sequence_id, ""))
        if request is None and (parent := self._aborting.get(sequence_id)) in self._closing:
            request = self._closing[parent][1]
        return request

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            self._failed = error  # a submit that passed _check_alive meanwhile finds it under the lock
            streams = list(self._streams.values()) + [stream for stream, _, _ in self._closing.values()]
            self._streams.clear()
            self._closing.clear()
            self._requests.clear()
            self._child_parent.clear()
            self._unaccepted.clear()
            self._aborting.clear()
            self._num_pending_sequences = 0
        _deliver([(stream, error) for stream in streams])


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            loop.call_soon_threadsafe(_put_all, batch)
