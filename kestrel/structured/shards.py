"""Grammar matchers in processes of their own (`grammar_workers`): each worker holds the matchers of a shard of the
constrained requests and writes their bitmask rows into shared memory, so a step's matcher advance and mask fill
run beside each other in the workers instead of one after the other on the engine's thread. xgrammar holds the GIL
in both calls, so threads of the engine's process cannot do this.

`GrammarShards` has the backend's contract (`structured/backend.py`); the engine cannot tell the two apart. Each
worker compiles the grammars of its own requests from their `GrammarSource` (a compiled grammar does not cross
processes cheaply: a 100-field schema serializes to 6.9 MB in 0.5 s), with its compiler's cache; the engine's
process compiles a grammar it was not handed compiled first, so an invalid grammar is refused at `add` as before.
A worker that dies takes the engine's step with it (a RuntimeError naming it), never a request silently.

The workers are forked from the process's fork server (`kestrel/fork_server.py`), which imports torch and xgrammar
once for all of them; the engine starts it before its model loads (`start_grammar_workers_early`), so those imports
run beside the load, and forks the workers when the backend is built: not in the step of the first constrained
request. The vocabulary reaches them with that first request (an engine core in its own process gets it
from its client only then).

Messages are tuples over a pipe, in order; a reply comes only for the calls that wait for one.
"""

from __future__ import annotations

import itertools
import os
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from kestrel.config import EngineConfig
from kestrel.engine.contracts import GrammarBitmask
from kestrel.fork_server import (
    fork_context,
    leave_stop_signals_to_the_server,
    start_fork_server,
    start_without_main,
)
from kestrel.sampling_params import StructuredOutputsParams
from kestrel.structured.backend import GrammarBackend, advance_matchers, fill_draft_rows, valid_draft_prefix
from kestrel.structured.compile import GrammarSource, compile_source

__all__ = ["GrammarShards", "engine_grammar_backend", "grammar_backend", "start_grammar_workers_early"]


def engine_grammar_backend(config: EngineConfig, runner: Any, tokenizer: Any) -> GrammarBackend:
    """An engine's backend from its config and runner: `grammar_workers` processes or its own thread, masks for
    `max_num_seqs` rows times the speculative tokens + 1, pinned where the runner is a GPU in this process (an
    executor's workers, `config.parallel.uses_workers`, get the masks pickled)."""
    gpu_host = engine_gpu_host(config, runner.device.type == "cuda")
    spec = config.speculative
    max_rows = config.scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
    return grammar_backend(tokenizer, runner.vocab_size, runner.eos_token_ids, config.grammar_workers, max_rows,
                           gpu_host)


# The most grammar workers by default: 8 brought a constrained step at batch 64 within 0.6-1.2% of an unconstrained
# one on the H200 (4: within 3%; the engine's thread alone: +3.5-51%; docs/benchmarks.md, "Grammar workers").
MAX_DEFAULT_WORKERS = 8


def engine_gpu_host(config: EngineConfig, on_cuda: bool) -> bool:
    """Whether an engine's model runner is on a CUDA device in the engine's own process (`on_cuda`: its device is;
    an executor's runners are in its workers)."""
    return not config.parallel.uses_workers and on_cuda


def grammar_worker_count(workers: int | None, gpu_host: bool) -> int:
    """`grammar_workers` as given, or `default_grammar_workers` where unset."""
    return workers if workers is not None else default_grammar_workers(gpu_host)


def default_grammar_workers(gpu_host: bool) -> int:
    """`grammar_workers` where unset: half the usable cores, at most MAX_DEFAULT_WORKERS, for a model runner on a
    CUDA device in the engine's process (whose host work a constrained step outlasts); 0 elsewhere (a CPU engine's
    cores run the model)."""
    if not gpu_host:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_DEFAULT_WORKERS, cores // 2)


def start_grammar_workers_early(config: EngineConfig, on_cuda: bool) -> None:
    """Start the fork server of the grammar workers an engine will have, importing their modules, before its model
    loads: those imports (torch and xgrammar, seconds) then run beside the load instead of between the load and the
    workers' start. `on_cuda`: whether the runner to be built will be on a CUDA device (engine_grammar_backend
    reads it from the runner)."""
    if grammar_worker_count(config.grammar_workers, engine_gpu_host(config, on_cuda)):
        start_fork_server(WORKER_MODULES)


def grammar_backend(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], workers: int | None,
                    max_rows: int, gpu_host: bool) -> GrammarBackend:
    """The engine's structured-outputs backend: the matchers in `workers` processes (`GrammarShards`, masks for
    up to `max_rows` rows a step), or on the engine's thread when `workers` is 0; None: `default_grammar_workers`."""
    workers = grammar_worker_count(workers, gpu_host)
    if workers:
        return GrammarShards(tokenizer, vocab_size, eos_token_ids, workers, max_rows, gpu_host=gpu_host)
    return GrammarBackend(tokenizer, vocab_size, eos_token_ids, gpu_host=gpu_host)


class GrammarShards(GrammarBackend):
    """The backend with its matchers in `workers` processes. `max_rows`: the most bitmask rows one step fills
    (max_num_seqs x (1 + speculative tokens)); a step with more fails loudly."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], workers: int,
                 max_rows: int, gpu_host: bool = False, **backend_options: Any) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids, gpu_host=gpu_host, **backend_options)
        self.worker_count = workers
        self._max_rows = max_rows
        self._words = (vocab_size + 31) // 32
        self._conns: list[Connection] = []
        self._shard_of: dict[str, int] = {}
        self._terminated: set[str] = set()
        self._next_shard = itertools.cycle(range(workers))
        self._memory: SharedMemory | None = None
        self._masks: Any = None  # int32 [2, max_rows, words] over the shared memory
        self._initialized = False
        self._launch()

    def _launch(self) -> None:
        """The workers and the shared masks, started now; each waits for the vocabulary (`_ready`)."""
        import torch

        size = 2 * self._max_rows * self._words * 4
        self._memory = SharedMemory(create=True, size=size)
        masks = torch.frombuffer(self._memory.buf, dtype=torch.int32).view(2, self._max_rows, self._words)
        if self._pin_memory:  # registered with the driver: the copies to the device stay asynchronous
            torch.cuda.cudart().cudaHostRegister(masks.data_ptr(), size, 0)
        self._masks = masks
        context = fork_context(WORKER_MODULES)
        processes = []
        try:
            for index in range(self.worker_count):
                parent, child = context.Pipe()
                process = context.Process(target=_worker_main, name=f"kestrel-grammar-{index}", daemon=True,
                                          args=(child, self._memory.name, self._max_rows, self._words))
                start_without_main(process)
                child.close()
                self._conns.append(parent)
                processes.append(process)
        finally:
            self._finalizer = weakref.finalize(self, _shut_down, self._conns, processes, self._memory, masks,
                                               self._pin_memory)

    def _ready(self) -> None:
        """Hand each worker the vocabulary and its fill threads, once, before its first request."""
        info = self.tokenizer_info.serialize_json()
        for index in range(self.worker_count):
            self._send(index, ("init", info, self._fill_threads_per_worker(), self._cache_bytes))
        for index in range(self.worker_count):
            self._receive(index)
        self._initialized = True

    def close(self) -> None:
        """Stop the workers and free the shared memory (also done when the backend is collected)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def _fill_threads_per_worker(self) -> int:
        return max(1, self._fill_threads // self.worker_count)

    # ----- requests ------------------------------------------------------------------------------

    def add(self, request_id: str, spec: StructuredOutputsParams, compiled: Any = None) -> None:
        if compiled is None:
            compiled = self.compile(spec)  # an invalid grammar is refused here, in the caller's thread
        if not self._initialized:
            self._ready()
        shard = next(self._next_shard)
        self._shard_of[request_id] = shard
        # The worker compiles the grammar's text (a forced tool call's spec holds only its marker).
        source = compiled if isinstance(compiled, GrammarSource) else GrammarSource("grammar", str(compiled.grammar))
        self._send(shard, ("add", request_id, source))

    def remove(self, request_id: str) -> None:
        shard = self._shard_of.pop(request_id, None)
        self._terminated.discard(request_id)
        if shard is not None:
            self._send(shard, ("remove", request_id))

    def accept_many(self, new_tokens: dict[str, list[int]]) -> dict[str, int]:
        started = time.perf_counter()
        counts = {rid: len(tokens) for rid, tokens in new_tokens.items() if rid not in self._shard_of}
        parts = self._by_shard(new_tokens.items())
        for shard, part in parts.items():
            self._send(shard, ("accept", dict(part)))
        for shard in parts:
            shard_counts, terminated = self._receive(shard)
            counts.update(shard_counts)
            self._terminated.update(terminated)
        self.accept_seconds += time.perf_counter() - started
        return counts

    def accept(self, request_id: str, token_ids: list[int]) -> int:
        return self.accept_many({request_id: token_ids})[request_id]

    def is_terminated(self, request_id: str) -> bool:
        return request_id in self._terminated

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        shard = self._shard_of.get(request_id)
        if shard is None or request_id in self._terminated:
            return []
        self._send(shard, ("drafts", request_id, drafts))
        return self._receive(shard)

    def bitmask(self, request_ids: list[str], drafts: dict[str, list[int]] | None = None) -> GrammarBitmask:
        started = time.perf_counter()
        drafts = drafts or {}
        req_ids: list[str] = []  # a request verifying drafts has one row per verified position, in order
        placed = []  # (rid, (rid, its first row, its drafts))
        for rid in request_ids:
            if rid in self._shard_of:
                own = drafts.get(rid, [])
                placed.append((rid, (rid, len(req_ids), own)))
                req_ids += [rid] * (len(own) + 1)
        if len(req_ids) > self._max_rows:
            raise RuntimeError(f"a step needs {len(req_ids)} grammar bitmask rows; the workers' shared masks hold "
                               f"{self._max_rows}")
        self._turn ^= 1
        parts = self._by_shard(placed)
        for shard, part in parts.items():
            self._send(shard, ("fill", self._turn, [entry for _, entry in part]))
        for shard in parts:
            self._receive(shard)
        self.fill_seconds += time.perf_counter() - started
        self.num_fills += 1
        return GrammarBitmask(req_ids, self._masks[self._turn, :len(req_ids)])

    # ----- plumbing ------------------------------------------------------------------------------

    def _by_shard(self, items: Any) -> dict[int, list[tuple[str, Any]]]:
        parts: dict[int, list[tuple[str, Any]]] = {}
        for rid, value in items:
            shard = self._shard_of.get(rid)
            if shard is not None:
                parts.setdefault(shard, []).append((rid, value))
        return parts

    def _send(self, shard: int, message: tuple) -> None:
        try:
            self._conns[shard].send(message)
        except OSError:  # a broken pipe: the worker is gone
            raise RuntimeError(f"grammar worker {shard} exited; the engine cannot constrain its requests") from None

    def _receive(self, shard: int) -> Any:
        try:
            status, value = self._conns[shard].recv()
        except (EOFError, OSError):
            raise RuntimeError(f"grammar worker {shard} exited; the engine cannot constrain its requests") from None
        if status != "ok":
            raise RuntimeError(f"grammar worker {shard} failed: {value}")
        return value


def _shut_down(conns: list[Connection], processes: list[Any], memory: SharedMemory, masks: Any,
               registered: bool) -> None:
    for conn in conns:
        conn.close()  # each worker ends at the end of its pipe
    for process in processes:
        process.join(timeout=20)  # a worker just forked on a loaded host can take seconds to reach its pipe
        if process.is_alive():
            process.kill()
    if registered:
        import torch

        torch.cuda.cudart().cudaHostUnregister(masks.data_ptr())
    del masks
    memory.close()
    memory.unlink()


# ----- the worker process --------------------------------------------------------------------------------


WORKER_MODULES = ("torch", "xgrammar", __name__)  # what the fork server imports for the workers


def _worker_main(conn: Connection, memory_name: str, max_rows: int, words: int) -> None:
    leave_stop_signals_to_the_server()  # ends when the engine closes the pipe
    import torch
    import xgrammar as xgr

    torch.set_num_threads(1)
    memory = SharedMemory(name=memory_name)
    masks = torch.frombuffer(memory.buf, dtype=torch.int32).view(2, max_rows, words)
    try:
        init = conn.recv()
    except (EOFError, OSError):  # the engine closed before its first constrained request
        init = None
    if init is not None:
        _serve(conn, init, masks, xgr)
    del masks
    memory.close()


def _serve(conn: Connection, init: tuple, masks: Any, xgr: Any) -> None:
    """Answer the engine's messages until it closes the pipe, on the vocabulary and fill threads of `init`."""
    _, tokenizer_info, fill_threads, cache_bytes = init
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info), max_threads=fill_threads,
                                   cache_enabled=True, cache_limit_bytes=cache_bytes)
    batch = xgr.BatchGrammarMatcher(max_threads=fill_threads)
    matchers: dict[str, Any] = {}
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = _handle(message, matchers, compiler, batch, masks, xgr)
        except Exception as error:  # noqa: BLE001 - reported to the engine, which raises it
            reply = ("error", f"{type(error).__name__}: {error}")
        if reply is not None:
            conn.send(reply)


def _handle(message: tuple, matchers: dict[str, Any], compiler: Any, batch: Any, masks: Any, xgr: Any) -> Any:
    kind = message[0]
    if kind == "add":
        _, rid, source = message
        matchers[rid] = xgr.GrammarMatcher(compile_source(compiler, source))
        return None
    if kind == "remove":
        matchers.pop(message[1], None)
        return None
    if kind == "accept":
        new_tokens = message[1]
        counts = advance_matchers(matchers, new_tokens)
        return "ok", (counts, [rid for rid in new_tokens if rid in matchers and matchers[rid].is_terminated()])
    if kind == "drafts":
        _, rid, drafts = message
        return "ok", valid_draft_prefix(matchers[rid], drafts)
    if kind == "fill":
        _, turn, entries = message
        plain = [(rid, first) for rid, first, drafts in entries if not drafts]
        if plain:
            batch.batch_fill_next_token_bitmask([matchers[rid] for rid, _ in plain], masks[turn],
                                                [first for _, first in plain])
        for rid, first, drafts in entries:
            if drafts:
                fill_draft_rows(matchers[rid], drafts, masks[turn], first)
        return "ok", None
    raise ValueError(f"unknown grammar worker message {kind!r}")
