"""Executors: the engine's `Runner` (`execute_model`, `sample_tokens`) over N worker processes.

Each call is broadcast to every worker in order; only rank 0 answers (all ranks hold the same outputs), and only
a blocking `sample_tokens` or a handle's `result()`. `execute_model` is never answered, and a step without
constrained rows is sent with its `sample_tokens` call (one call per step, as no bitmask is filled in between);
`sample_tokens(non_block=True)` returns a handle at once and the workers keep the step under its key, so async
scheduling still overlaps the host with the device. The engine's process loads no model: torch is not imported
here.

Under pipeline parallelism the last stage's first rank answers instead, each step as soon as it has run (the
engine keeps several batches in flight and collects the oldest); its replies arrive in call order and are kept
until collected, and each collected step's sampled ids go back to every worker (RECORD) for the earlier stages.

A worker that dies or reports an error, or a reply that does not come within `distributed_timeout_s`, stops
every worker and raises `WorkerError` from the call (and from every later one): the engine fails its requests
with that error, and `healthy` turns False (the server's /health answers 503).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import socket
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import Any

from kestrel.config import EngineConfig
from kestrel.engine.contracts import GrammarBitmask, ModelRunnerOutput, Ready, SchedulerOutput
from kestrel.executor.worker import (
    CALIBRATE_KV,
    EXECUTE_MODEL,
    EXPERT_LOAD,
    RECORD,
    RESULT,
    SAMPLE_TOKENS,
    SHUTDOWN,
    WorkerInfo,
    WorkerSpec,
    reply_rank,
    worker_process_main,
)
from kestrel.fork_server import fork_context, start_without_main
from kestrel.worker.runner_setup import runs_on_cpu

logger = logging.getLogger(__name__)
# What a CPU rank imports before it starts: a fork server that forks ranks imports these for them.
CPU_RANK_MODULES = (worker_process_main.__module__,)
PEER_EXIT_GRACE_S = 1.0
SHUTDOWN_WAIT_S = 5.0  # for a call in flight to leave the workers' pipes


class WorkerError(RuntimeError):
    """A worker process died, failed or stopped answering; the executor cannot run steps any more."""


@dataclass(frozen=True)
class DeviceInfo:
    """The workers' device kind, where the engine looks for `runner.device.type`."""

    type: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def threads_per_rank(world_size: int) -> int:
    """Ranks sharing this machine's cores split them (on a GPU the count hardly matters)."""
    return max(1, (os.cpu_count() or 1) // world_size)


class Executor(ABC):
    """The Runner contract over workers; subclasses move the calls."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel.world_size
        self.timeout_s = config.parallel.distributed_timeout_s
        self._keys = itertools.count()
        self._error: str | None = None
        self.reply_rank = reply_rank(config)
        self.pipelined = config.parallel.pipeline_parallel_size > 1
        self._awaiting: deque[int] = deque()  # pipelined: the steps whose replies are due, in call order
        self._arrived: dict[int, ModelRunnerOutput] = {}  # pipelined: replies read, not yet collected
        self._unsent: SchedulerOutput | None = None  # executed, sent with its sample_tokens call
        # The workers' pipes (or refs) and processes are used by the engine thread's calls and by a health check or
        # a shutdown from another thread (the server's): one at a time, so that no pipe is written by two threads
        # at once or closed under a reader, and no exit status is read by two. (A health check reads only the pipe
        # of a rank that is gone.)
        self._io = threading.RLock()

    def _adopt(self, info: WorkerInfo) -> None:
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.num_blocks = info.num_blocks
        self.kv_layout = info.kv_layout
        self.block_size = info.block_size
        self.device = DeviceInfo(info.device_type)
        self.capture_seconds = info.capture_seconds
        self.weight_bytes = info.weight_bytes
        self.kv_bytes_per_token = info.kv_bytes_per_token

    # ----- the two verbs --------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Ready | None:
        """Send the step to every worker, or keep it for its `sample_tokens` call when it has no constrained rows
        (nothing is filled in between, and one call per step costs one pickling and one pipe write per worker).
        No worker answers it, so this never waits and `non_block` only wraps the value."""
        if self._unsent is not None:
            raise RuntimeError("execute_model was called again before the executed step's sample_tokens")
        output = None
        if scheduler_output.is_empty:  # it only releases requests: they reach every worker, nothing comes back
            self._send((EXECUTE_MODEL, None, scheduler_output))
            output = ModelRunnerOutput([], [])
        elif scheduler_output.structured_output_request_ids:  # the forward runs while the bitmask is filled
            self._send((EXECUTE_MODEL, None, scheduler_output))
        else:
            self._unsent = scheduler_output
        return Ready(output) if non_block else output

    def sample_tokens(self, grammar_output: GrammarBitmask | None,
                      non_block: bool = False) -> ModelRunnerOutput | _PendingStep:
        """Sample the executed step on the workers; wait for the reply rank's output, or with `non_block` return
        a handle that asks for it (pipelined: that reads the last stage's answer, sent unasked)."""
        scheduler_output, self._unsent = self._unsent, None
        key = next(self._keys)
        answer_now = not non_block and not self.pipelined
        self._send((SAMPLE_TOKENS, key, (scheduler_output, grammar_output, answer_now)))
        if answer_now:
            return self._reply()
        if self.pipelined:
            self._awaiting.append(key)
        pending = _PendingStep(self, key)
        return pending if non_block else pending.result()

    def _result(self, key: int) -> ModelRunnerOutput:
        if self.pipelined:
            return self._stage_output(key)
        self._send((RESULT, None, key))
        return self._reply()

    def calibrate_kv_scales(self) -> list[tuple[float, float]]:
        """`ModelRunner.calibrate_kv_scales` on every rank at once (before any step); the reply rank's scales."""
        self._send((CALIBRATE_KV, None, None))
        return self._reply()

    def expert_load(self) -> dict[int, list[int]]:
        """`ModelRunner.expert_load` of the reply rank (every rank counts every token); between steps."""
        self._send((EXPERT_LOAD, None, None))
        return self._reply()

    # ----- pipeline parallelism -------------------------------------------------------------------------

    def _stage_output(self, key: int) -> ModelRunnerOutput:
        """Step `key`'s output (reading the replies due before it), after sending its sampled ids to the earlier
        stages: they reach every worker before any later call that could read them."""
        while key not in self._arrived:
            if not self._awaiting:
                raise RuntimeError(f"step {key} is not in flight (never launched, or collected already)")
            due = self._awaiting.popleft()
            answered, output = self._reply()
            if answered != due:
                raise self._fail(f"rank {self.reply_rank} answered step {answered} where step {due} was due")
            self._arrived[due] = output
        output = self._arrived.pop(key)
        self._send((RECORD, None, (output.req_ids, output.sampled_token_ids)))
        return output

    # ----- health -----------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False once a worker failed. While the engine thread is inside a call, that call finds a failure itself
        (it watches every worker), so the check does not wait for it."""
        if self._error is None and self._io.acquire(blocking=False):
            try:
                dead = self._dead_worker()
                if dead is not None:
                    self._fail(dead)
            finally:
                self._io.release()
        return self._error is None

    @property
    def error(self) -> WorkerError | None:
        return None if self._error is None else WorkerError(self._error)

    def _check(self) -> None:
        if self._error is not None:
            raise WorkerError(self._error)

    def _fail(self, reason: str) -> WorkerError:
        """Record the first failure, stop every worker, and return the error to raise."""
        if self._error is None:
            self._error = f"distributed executor failed: {reason}; the engine cannot run steps any more"
            logger.error(self._error)
            self.shutdown()
        return WorkerError(self._error)

    def _send(self, call: tuple) -> None:
        payload = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        with self._io:
            self._check()
            self._broadcast(payload)

    def _reply(self) -> Any:
        """The reply rank's next reply, in call order: an output (or `(key, output)` when pipelined)."""
        with self._io:
            return self._await_reply()

    @abstractmethod
    def _broadcast(self, payload: bytes) -> None: ...

    @abstractmethod
    def _await_reply(self) -> Any:
        """`_reply`'s wait, under the executor's I/O lock."""

    @abstractmethod
    def _dead_worker(self) -> str | None:
        """What happened to a worker that is gone, or None while all live."""

    @abstractmethod
    def shutdown(self) -> None: ...


class _PendingStep:
    """`sample_tokens(non_block=True)`'s handle: `result()` waits for the step's output once."""

    def __init__(self, executor: Executor, key: int) -> None:
        self._executor = executor
        self._key = key
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._result(self._key)
        return self._output


class MultiprocExecutor(Executor):
    """`mp`: one process per rank on this machine (rank r on GPU r), pipes to each. GPU ranks are spawned; CPU
    ranks are forked by the fork server, which imports the worker's modules once for every engine of the process
    when the executor is first to start it (`LLM`; in `kestrel serve` the worker pools start it first, and the
    ranks import them after the fork, as spawned ones do)."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        super().__init__(config)
        ctx = fork_context(CPU_RANK_MODULES) if runs_on_cpu(config.device) else get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        threads = threads_per_rank(self.world_size) if config.device != "cuda" else None
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            spec = WorkerSpec(config, eos_token_id, rank, init_method, device_index=rank, num_threads=threads)
            proc = ctx.Process(target=worker_process_main, args=(spec, child), daemon=True,
                               name=f"kestrel-worker-{rank}")
            start_without_main(proc)  # a rank runs kestrel's functions only: not an unguarded script again
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns)
        infos = [self._receive(rank, "start") for rank in range(self.world_size)]
        self._adopt(infos[0])
        logger.info("%d worker processes ready (tp=%d, pp=%d, %d KV blocks)", self.world_size,
                    config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size, self.num_blocks)

    def _receive(self, rank: int, what: str) -> Any:
        """The next message of `rank`, watching every other worker for an error or an exit meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        conn = self._conns[rank]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(f"rank {rank} did not answer ({what}) within distributed_timeout_s="
                                 f"{self.timeout_s:g}")
            # Between steps the other ranks send nothing but an error; at start each sends its "ready" in turn.
            others = [c for c in self._conns if c is not conn] if what == "step" else []
            ready = wait([conn, *others, *(p.sentinel for p in self._procs)], timeout=remaining)
            for other in others:
                if other in ready:
                    raise self._fail(self._describe(self._conns.index(other)))
            if conn in ready:
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    raise self._fail(self._describe(rank)) from None
                if status == "error":
                    raise self._fail(self._root_cause(rank, value))
                return value
            for i, proc in enumerate(self._procs):
                if proc.sentinel in ready:
                    raise self._fail(self._describe(i))

    def _root_cause(self, rank: int, error: str, grace_s: float = PEER_EXIT_GRACE_S) -> str:
        """`rank`'s reported error, or first the death of a peer that it reports: a killed rank's sockets can
        close (and its peer report the reset) before its pipe does, so a peer's exit is waited for a moment. Only a
        peer ended by a signal (killed, or crashed) is blamed: one that failed on its own reported its error and
        exited with code 1, as do the peers that fail on a rank's error in turn."""
        deadline = time.monotonic() + grace_s
        live = {i: proc for i, proc in enumerate(self._procs) if i != rank}
        while True:
            for i, proc in list(live.items()):
                if not proc.is_alive():
                    if (proc.exitcode or 0) < 0:
                        return f"{self._exit_of(i)} (then rank {rank} failed: {error})"
                    del live[i]
            remaining = deadline - time.monotonic()
            if not live or remaining <= 0:
                return f"rank {rank} failed: {error}"
            wait([proc.sentinel for proc in live.values()], timeout=remaining)

    def _describe(self, rank: int, grace_s: float = PEER_EXIT_GRACE_S) -> str:
        """Why `rank` stopped: its reported error (or the peer's death behind it), else its exit."""
        conn = self._conns[rank]
        try:
            while conn.poll():
                status, value = conn.recv()
                if status == "error":
                    return self._root_cause(rank, value, grace_s)
        except (EOFError, OSError):
            pass
        return self._exit_of(rank)

    def _exit_of(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(1.0)
        return f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"

    def _broadcast(self, payload: bytes) -> None:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                raise self._fail(self._describe(rank)) from None

    def _await_reply(self) -> Any:
        return self._receive(self.reply_rank, "step")

    def _dead_worker(self) -> str | None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():  # a health check: no waiting for the other ranks' exits
                return self._describe(rank, grace_s=0.0)
        return None

    def shutdown(self) -> None:
        """Stop every worker and close the pipes; while a call in flight holds them (the engine thread past its
        join), only end the workers: that call finds them gone and closes the pipes itself."""
        if self._io.acquire(timeout=SHUTDOWN_WAIT_S):
            try:
                self._finalizer()
            finally:
                self._io.release()
            return
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.kill()


def _stop_processes(procs: list[Any], conns: list[Connection]) -> None:
    """Ask each worker to stop, then end the ones that do not within a few seconds."""
    stop = pickle.dumps((SHUTDOWN, None, None))
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(stop)
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
