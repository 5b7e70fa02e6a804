"""The engine core in its own process (`kestrel serve --engine-core-process`): scheduler, model runner and grammar
matchers, fed by the API server over a pipe (kestrel.entrypoints.core_protocol).

The step loop never waits on the client: it takes what has arrived on the pipe between steps (and sleeps on it only
when it has nothing to run), and a writer thread sends each step's outputs while the next step runs. Grammars
arrive as their source and compile in a thread of their own; the request joins the scheduler once its grammar is
ready.

The process ends with its server: the kernel kills it when the server process dies (PR_SET_PDEATHSIG), and the
loop exits when it finds the pipe closed (an executor's worker processes then see their own pipes close).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

from kestrel.config import EngineConfig
from kestrel.engine.serving_gc import tune_for_serving
from kestrel.engine.stats_logger import StatsLogger
from kestrel.entrypoints.core_protocol import (
    ABORT,
    ADD,
    COMPILED,
    ERROR,
    READY,
    SHUTDOWN,
    STEP,
    TOKENIZER_INFO,
    delta_to_wire,
    error_to_wire,
    pack,
    params_from_wire,
    unpack,
)
from kestrel.entrypoints.engine_factory import BuiltEngine, build_engine_core
from kestrel.entrypoints.engine_stats import StatsTracker
from kestrel.fork_server import leave_stop_signals_to_the_server
from kestrel.outputs import SequenceDelta
from kestrel.request import InvalidRequestError
from kestrel.structured.compile import GrammarCompileError, GrammarSource, compile_source

logger = logging.getLogger("kestrel.engine_core")
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
PROCESS_NAME = b"kestrel-core"  # what `ps` and /proc/<pid>/comm show for the core process


def build_model_core(config: EngineConfig, eos_token_id: int | None) -> BuiltEngine:
    """The core of `kestrel serve`: the model's runner, no tokenizer."""
    return build_engine_core(config, None, eos_token_id, deltas=True)


@dataclass(frozen=True)
class CoreProcessSpec:
    """What the core process needs to start; handed over once, at spawn. `build`: a module-level function (it is
    pickled by name) that builds the engine core from the config and the EOS id; `kestrel bench host-step --split`
    gives one whose runner costs nothing."""

    config: EngineConfig
    parent_pid: int
    log_level: int | str = "WARNING"
    build: Callable[[EngineConfig, int | None], BuiltEngine] = build_model_core


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process when its server does, even while a step holds the interpreter (the
    reader's end-of-pipe exit needs it free). The process takes the name PROCESS_NAME."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(PROCESS_NAME))
    if os.getppid() != parent_pid:  # the server died before the request above took effect
        os._exit(0)


def core_process_main(spec: CoreProcessSpec, conn: Connection) -> None:
    leave_stop_signals_to_the_server()
    _die_with_parent(spec.parent_pid)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # The tokenizer's EOS id (the core loads no tokenizer), sent once the client has loaded it: the two loads
        # overlap.
        eos_token_id = unpack(conn.recv_bytes())[1]
        built = spec.build(spec.config, eos_token_id)
    except BaseException as error:  # noqa: BLE001 - reported to the server, which raises it to the user
        logger.debug("engine core start-up failed: %s", traceback.format_exc())
        with contextlib.suppress(OSError):
            conn.send_bytes(pack([ERROR, error_to_wire(error)]))
        os._exit(1)
    runner = built.runner
    tune_for_serving()
    conn.send_bytes(pack([READY, {
        "vocab_size": runner.vocab_size, "eos_token_ids": sorted(runner.eos_token_ids),
        "num_blocks": built.core.num_blocks, "dtype": str(getattr(runner, "dtype", "?")),
        "device": str(getattr(runner, "device", spec.config.device)),
        "capture_seconds": getattr(runner, "capture_seconds", None),
        "graphs_pending": bool(getattr(runner, "graphs_pending", False)),
    }]))
    code = 0
    try:
        loop = _CoreLoop(built.core, conn)
    except BaseException as error:  # noqa: BLE001 - reported to the server, which fails every request
        logger.exception("the engine core could not start its loop")
        with contextlib.suppress(OSError):
            conn.send_bytes(pack([ERROR, error_to_wire(error)]))  # no writer thread yet: this one is the only one
        code = 1
    else:
        try:
            loop.run()
        except BaseException:  # noqa: BLE001 - reported to the server (by the loop's writer), which fails every request
            logger.exception("the engine core stopped after an error")
            code = 1
    stop_workers = getattr(runner, "shutdown", None)
    if stop_workers is not None:
        stop_workers()
    os._exit(code)


class _CoreLoop:
    def __init__(self, core: Any, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.stats = StatsTracker()
        self._stats_logger = None if core.config.disable_log_stats else StatsLogger()
        self._compiles = ThreadPoolExecutor(1, thread_name_prefix="kestrel-core-grammar")
        self._compiling: dict[str, list[Any]] = {}  # request id -> its ADD message, until the grammar is ready
        self._compiled: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self._wake, self._wake_writer = Pipe(duplex=False)  # a compile finished: wakes an idle loop
        self._accepted: list[str] = []
        self._refused: list[list[Any]] = []
        self._aborted: list[str] = []  # aborts applied since the last STEP, which says so to the client
        self._abort_deltas: list[SequenceDelta] = []  # their sequences' last deltas (finish_reason "abort")
        self._prompt_logprobs_sent: dict[str, int] = {}
        self._writer = threading.Thread(target=self._write, name="kestrel-core-writer", daemon=True)
        self._writer.start()

    def _write(self) -> None:
        with contextlib.suppress(OSError):
            while (payload := self.outbox.get()) is not None:
                self.conn.send_bytes(payload)

    def _receive(self, block: bool) -> list[list[Any]]:
        """What arrived since the last step: the client's messages and the grammars compiled meanwhile; with
        `block` (nothing to run), wait for one first. The loop reads the pipe itself: a reader thread would hand
        each message over only when the loop next yields the interpreter."""
        if block:
            wait([self.conn, self._wake])
        messages = []
        while self._wake.poll():
            self._wake.recv_bytes()
        with contextlib.suppress(queue.Empty):
            while True:
                messages.append(self._compiled.get_nowait())
        try:
            while self.conn.poll():
                messages.append(unpack(self.conn.recv_bytes()))
        except (EOFError, OSError):
            os._exit(0)  # the server is gone: nobody is left to serve
        return messages

    def run(self) -> None:
        """Serve until SHUTDOWN; an error ends the loop too, reported to the client as the last message the writer
        sends (after the steps queued before it: the pipe has one writer)."""
        try:
            self._serve()
        except BaseException as error:
            self._stop_writer(pack([ERROR, error_to_wire(error)]))
            raise
        self._stop_writer(None)

    def _stop_writer(self, last: bytes | None) -> None:
        self._compiles.shutdown(wait=False, cancel_futures=True)
        if last is not None:
            self.outbox.put(last)
        self.outbox.put(None)
        self._writer.join(5.0)

    def _serve(self) -> None:
        core = self.core
        while True:
            busy = core.has_unfinished_requests()
            if not busy and self._stats_logger is not None:
                self._stats_logger.maybe_log(core.scheduler, force=True)  # the last line of a busy spell
            messages = self._receive(block=not busy and not core.has_idle_work)
            if any(m[0] == SHUTDOWN for m in messages):
                break
            for message in messages:
                self._handle(message)
            outputs, self._abort_deltas = self._abort_deltas, []
            if core.has_unfinished_requests():
                outputs += core.step()
                self.stats.count_step(core.scheduler)
                if self._stats_logger is not None:
                    self._stats_logger.maybe_log(core.scheduler)
            else:
                core.do_idle_work()  # one pending CUDA graph between looks at the pipe
            if outputs or self._accepted or self._refused or self._aborted or busy:
                self._send_step(outputs)

    def _handle(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == ABORT:
            ids = message[1]
            for request_id in ids:
                self._compiling.pop(request_id, None)
                self._prompt_logprobs_sent.pop(request_id, None)
            self._abort_deltas += self.core.abort_request(ids)
            self._aborted.extend(ids)
        elif kind == ADD:
            _, request_id, _, params, _, grammar, _ = message
            if grammar is None and params[0] == "sampling" and params[1].get("structured_outputs") is not None:
                grammar = "spec"  # the backend checks the spec's limits and compiles it, in the compile thread
            if grammar is not None:
                self._compiling[request_id] = message
                self._compiles.submit(self._compile, request_id, message)
            else:
                self._add(message, None)
        elif kind == TOKENIZER_INFO:
            self.core.structured.use_tokenizer_info(message[1])
        elif kind == COMPILED:
            _, request_id, compiled, error = message
            add = self._compiling.pop(request_id, None)
            if add is None:
                return  # aborted while compiling
            if error is not None:
                self._refused.append([request_id, error_to_wire(error)])
            else:
                self._add(add, compiled)

    def _compile(self, request_id: str, message: list[Any]) -> None:
        """In the compile thread: the grammar of an ADD, handed back to the loop (`_receive`)."""
        params, grammar = params_from_wire(message[3]), message[5]
        try:
            backend = self.core.structured
            if backend is None:
                raise ValueError("this engine has no grammar backend for structured outputs")
            if grammar == "spec":
                compiled = backend.compile(params.structured_outputs)
            else:
                compiled = compile_source(backend.compiler, GrammarSource(*grammar))
            result = [COMPILED, request_id, compiled, None]
        except GrammarCompileError as error:
            result = [COMPILED, request_id, None, InvalidRequestError("structured_outputs", str(error))]
        except Exception as error:  # noqa: BLE001 - the request's refusal
            result = [COMPILED, request_id, None, error]
        self._compiled.put(result)
        self._wake_writer.send_bytes(b"")

    def _add(self, message: list[Any], compiled: Any) -> None:
        _, request_id, prompt_token_ids, params, priority, _, cache_salt = message
        try:
            self.core.add_request(request_id, prompt_token_ids, params_from_wire(params), None, priority, compiled,
                                  cache_salt=cache_salt)
        except ValueError as refusal:  # InvalidRequestError and friends: this request only
            self._refused.append([request_id, error_to_wire(refusal)])
            return
        self._accepted.append(request_id)

    def _send_step(self, deltas: list[SequenceDelta]) -> None:
        records = []
        sent = self._prompt_logprobs_sent
        for delta in deltas:
            prompt_logprobs = delta.prompt_logprobs
            if prompt_logprobs is None and delta.metrics is None and delta.new_logprobs is None:
                records.append(delta)  # a plain decode step's record is the delta's own fields (a tuple packs as one)
                continue
            changed = prompt_logprobs is not None and len(prompt_logprobs) != sent.get(delta.request_id, 0)
            if changed:
                sent[delta.request_id] = len(prompt_logprobs)
            if delta.finish_reason is not None:
                sent.pop(delta.request_id, None)
            records.append(delta_to_wire(delta, changed))
        stats = self.stats.snapshot(self.core.scheduler).to_wire()
        self.outbox.put(pack([STEP, self._accepted, self._refused, records, stats, self._aborted]))
        self._accepted, self._refused, self._aborted = [], [], []
