"""Worker: one rank's process-side state (device, process groups, the model shard, KV cache) around a
`ModelRunner`, and the calls an executor makes on it.

Every rank runs the same runner logic on the same scheduler outputs: the sharded layers meet in their
collectives, and every rank of a tensor-parallel group ends a step with the same logits (gathered over tp) and
samples the same tokens (same seeds), so each keeps its own request state and one rank reports back.

Under pipeline parallelism every stage runs its layers of each executed step and only the last stage samples; its
first rank reports each step as soon as the step has run (a step sampled without waiting does not wait for its
result call), and the engine sends the sampled ids back to the earlier stages (RECORD) before any later step reads
them. No collective spans stages except the hidden states each stage sends to the next, so a stage never waits on
a later one and several batches can be in flight.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kestrel.config import ConfigError, EngineConfig
from kestrel.distributed.parallel import backend_for, init_parallel, shutdown_parallel
from kestrel.engine.contracts import ModelRunnerOutput
from kestrel.fork_server import leave_stop_signals_to_the_server
from kestrel.kv_spec import KVCacheLayout
from kestrel.worker.model_runner import ModelRunner
from kestrel.worker.runner_setup import resolve_device


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to start; picklable."""

    config: EngineConfig
    eos_token_id: int | None
    rank: int
    init_method: str  # "tcp://host:port" of rank 0's process-group store
    device_index: int | None = None  # this rank's CUDA device; None: the first visible one
    num_threads: int | None = None  # torch CPU threads (ranks sharing a machine split its cores)


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine needs to know of the model, reported by rank 0 after loading."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    num_blocks: int
    block_size: int
    device_type: str
    capture_seconds: float
    weight_bytes: dict[str, int]  # this rank's parameters: total, embedding, per_step (the benches' roofline)
    kv_bytes_per_token: int  # this rank's KV cache bytes per token
    kv_layout: KVCacheLayout  # the KV-cache groups and their blocks, as the engine schedules them


# Calls: (op, key, payload), the engine's two verbs. EXECUTE_MODEL: a scheduler output, never answered (the
# workers keep the executed step). SAMPLE_TOKENS: (scheduler output or None, grammar bitmask, answer now); a
# scheduler output in it is executed first (a step without constrained rows travels as one call), and the sampled
# step is kept under `key` unless answered now. RESULT: the key of a kept step, answered with its output.
EXECUTE_MODEL, SAMPLE_TOKENS, RESULT, SHUTDOWN = "execute_model", "sample_tokens", "result", "shutdown"
# Pipeline parallelism: (req_ids, sampled_token_ids) of a step the last stage ran, for the earlier stages.
RECORD = "record"
# FP8 KV scales from one calibration prefill that every rank runs together (its collectives and stage sends meet);
# each rank measures its own layers and kv heads. Answered with the reply rank's scales.
CALIBRATE_KV = "calibrate_kv"
# The expert-load counts now (`expert_load_metrics`; every rank routes every token): the reply rank's.
EXPERT_LOAD = "expert_load"


def reply_rank(config: EngineConfig) -> int:
    """The rank whose replies the executor reads: the first of the last pipeline stage (rank 0 without one)."""
    parallel = config.parallel
    return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        config = spec.config
        parallel_config = config.parallel
        device = resolve_device(config.device)
        if device.type == "cuda":
            index = spec.device_index or 0
            if index >= torch.cuda.device_count():
                raise ConfigError(f"invalid tensor_parallel_size x pipeline_parallel_size = "
                                  f"{parallel_config.world_size}: rank {spec.rank} needs GPU {index} and this machine "
                                  f"has {torch.cuda.device_count()}; use fewer ranks or the ray backend across nodes")
            torch.cuda.set_device(index)
        self.rank = spec.rank
        self.parallel = init_parallel(spec.rank, parallel_config.tensor_parallel_size,
                                      parallel_config.pipeline_parallel_size, spec.init_method, backend_for(device),
                                      parallel_config.distributed_timeout_s, parallel_config.enable_expert_parallel)
        self.runner = ModelRunner(config, spec.eos_token_id, self.parallel)
        self._steps: dict[int, Any] = {}

    def info(self) -> WorkerInfo:
        r = self.runner
        total = sum(t.numel() * t.element_size() for t in r.model.parameters())
        embedding = r.model.get_input_embeddings()
        embed = 0 if embedding is None else sum(t.numel() * t.element_size() for t in embedding.parameters())
        spec = r.kv_spec
        kv_per_token = spec.bytes_per_block // spec.block_size
        return WorkerInfo(r.vocab_size, frozenset(r.eos_token_ids), r.num_blocks, r.block_size, r.device.type,
                          r.capture_seconds, {"total": total, "embedding": embed, "per_step": total - embed},
                          kv_per_token, r.kv_layout)

    def handle(self, call: tuple[str, int | None, Any]) -> Any:
        """Run one call; the output of an answered `sample_tokens` or a `result`, else None. Under pipeline
        parallelism, `(key, output)` of each `sample_tokens` on the last stage (answered once the step has run),
        else None."""
        op, key, payload = call
        runner = self.runner
        if op == CALIBRATE_KV:
            return runner.calibrate_kv_scales()
        if op == EXPERT_LOAD:
            return runner.expert_load()
        if op == EXECUTE_MODEL:
            runner.execute_model(payload)
            return None
        if self.parallel.pp_size > 1:
            return self._handle_stage(op, key, payload)
        if op == SAMPLE_TOKENS:
            scheduler_output, grammar, answer = payload
            if scheduler_output is not None:
                runner.execute_model(scheduler_output)
            if answer:
                return runner.sample_tokens(grammar)
            self._steps[key] = runner.sample_tokens(grammar, non_block=True)
            return None
        if op == RESULT:
            return self._steps.pop(payload).result()
        raise ValueError(f"unknown worker call {op!r}")

    def _handle_stage(self, op: str, key: int | None, payload: Any) -> tuple[int, ModelRunnerOutput] | None:
        """A pipeline stage: every stage runs its layers of each executed step; the last one samples and answers,
        the earlier ones record the sampled ids the engine sends back (RECORD)."""
        runner = self.runner
        if op == SAMPLE_TOKENS:
            scheduler_output, grammar, _ = payload
            if scheduler_output is not None:
                runner.execute_model(scheduler_output)
            return (key, runner.sample_tokens(grammar)) if self.parallel.is_last_stage else None
        if op == RECORD:
            if not self.parallel.is_last_stage:  # the last stage sampled them
                runner.record_sampled(*payload)
            return None
        raise ValueError(f"unknown worker call {op!r} under pipeline parallelism")

    def close(self) -> None:
        shutdown_parallel()


class _Outbox:
    """Replies written by a thread. A pipeline's last stage answers steps unasked while the engine may be
    writing the next call to it: were both blocked writing into full pipes, neither would read."""

    def __init__(self, conn: Connection, lock: threading.Lock) -> None:
        self._conn = conn
        self._lock = lock
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kestrel-replies", daemon=True).start()

    def put(self, payload: bytes) -> None:
        self._queue.put(payload)

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                payload = self._queue.get()
                with self._lock:
                    self._conn.send_bytes(payload)


def worker_process_main(spec: WorkerSpec, conn: Connection) -> None:
    """The body of an `mp` worker process: start, report, then serve calls from the engine's pipe until told
    to stop (or the pipe closes: the engine process is gone). Only the reply rank sends outputs; any rank sends
    its error and exits, which the executor sees at once."""
    leave_stop_signals_to_the_server()
    lock = threading.Lock()
    try:
        worker = Worker(spec)
        conn.send(("ready", worker.info() if spec.rank == 0 else None))
        replies = spec.rank == reply_rank(spec.config)
        outbox = _Outbox(conn, lock) if replies and spec.config.parallel.pipeline_parallel_size > 1 else None
        while True:
            call = pickle.loads(conn.recv_bytes())
            if call[0] == SHUTDOWN:
                break
            result = worker.handle(call)
            if result is not None and replies:
                payload = pickle.dumps(("ok", result))
                if outbox is not None:
                    outbox.put(payload)
                else:
                    conn.send_bytes(payload)
    except EOFError:
        pass  # the engine process is gone
    except BaseException as error:  # noqa: BLE001 - reported to the engine, then the process ends
        # Bounded: the reply thread may hold the pipe; the executor then sees the exit instead of the message.
        if lock.acquire(timeout=5.0):
            with contextlib.suppress(OSError):
                conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        os._exit(1)  # a rank stuck in a collective with a dead peer must not keep the process alive
    # Tearing the process group down would wait on peers that may be gone; the process ends here anyway.
    os._exit(0)
