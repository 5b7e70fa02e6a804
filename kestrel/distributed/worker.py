"""Worker: one rank's process-side state (device, process groups, the model shard, KV cache) around a
`ModelRunner`, and the calls an executor makes on it.

Every rank runs the same runner logic on the same scheduler outputs: the sharded layers meet in their
collectives, and every rank of a tensor-parallel group ends a step with the same logits (gathered over tp) and
samples the same tokens (same seeds), so each keeps its own request state and one rank reports back.

Under pipeline parallelism only the last stage samples; its first rank reports each step as soon as the step has
run (a launched step does not wait for its collect), and the engine sends the sampled ids back to the earlier
stages (RECORD) before any later step reads them. No collective spans stages except the hidden states each stage
sends to the next, so a stage never waits on a later one and several batches can be in flight.
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


# Calls: (op, key, payload). A key names a forwarded / launched step kept on the worker until collected, so
# the executor never waits for a reply that only hands back a handle.
EXECUTE, FORWARD, SAMPLE, LAUNCH, COLLECT, SHUTDOWN = "execute", "forward", "sample", "launch", "collect", "shutdown"
# Pipeline parallelism: (req_ids, sampled_token_ids) of a step the last stage ran, for the earlier stages.
RECORD = "record"
# FP8 KV scales from one calibration prefill that every rank runs together (its collectives and stage sends meet);
# each rank measures its own layers and kv heads. Answered with the reply rank's scales.
CALIBRATE_KV = "calibrate_kv"


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
                                      parallel_config.distributed_timeout_s)
        self.runner = ModelRunner(config, spec.eos_token_id, self.parallel)
        self._steps: dict[int, Any] = {}

    def info(self) -> WorkerInfo:
        r = self.runner
        total = embed = 0
        for name, t in r.model.named_parameters():
            total += t.numel() * t.element_size()
            embed += t.numel() * t.element_size() if "embed_tokens" in name else 0
        spec = r.kv_spec
        kv_per_token = spec.bytes_per_block // spec.block_size
        return WorkerInfo(r.vocab_size, frozenset(r.eos_token_ids), r.num_blocks, r.block_size, r.device.type,
                          r.capture_seconds, {"total": total, "embedding": embed, "per_step": total - embed},
                          kv_per_token)

    def handle(self, call: tuple[str, int | None, Any]) -> Any:
        """Run one call; the output of `execute` / `collect`, else None. Under pipeline parallelism,
        `(key, output)` of each call that runs a step to its end on the last stage, else None."""
        if call[0] == CALIBRATE_KV:
            return self.runner.calibrate_kv_scales()
        if self.parallel.pp_size > 1:
            return self._handle_stage(call)
        op, key, payload = call
        runner = self.runner
        if op == EXECUTE:
            scheduler_output, grammar = payload
            return runner.execute(scheduler_output, grammar)
        if op == FORWARD:
            self._steps[key] = runner.forward(payload)
        elif op == SAMPLE:
            forwarded, grammar = payload
            self._steps[key] = runner.sample(self._steps.pop(forwarded), grammar)
        elif op == LAUNCH:
            self._steps[key] = runner.launch(payload)
        elif op == COLLECT:
            return runner.collect(self._steps.pop(payload))
        else:
            raise ValueError(f"unknown worker call {op!r}")
        return None

    def _handle_stage(self, call: tuple[str, int | None, Any]) -> tuple[int, ModelRunnerOutput] | None:
        op, key, payload = call
        runner = self.runner
        if self.parallel.is_last_stage:
            if op == EXECUTE:
                return key, runner.execute(*payload)
            if op == LAUNCH:
                return key, runner.execute(payload)
            if op == FORWARD:
                self._steps[key] = runner.forward(payload)
                return None
            if op == SAMPLE:
                forwarded, grammar = payload
                return key, runner.collect(runner.sample(self._steps.pop(forwarded), grammar))
            if op == RECORD:
                return None  # this stage sampled them
        elif op in (EXECUTE, LAUNCH, FORWARD):
            runner.forward_stage(payload[0] if op == EXECUTE else payload)
            return None
        elif op == SAMPLE:
            return None
        elif op == RECORD:
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
