"""Compile the Triton kernels a set of forwards will launch in parallel processes, before running them.

A cold start spends most of its extra time compiling Triton kernels one after another as the CUDA graphs are
captured (each compile holds this process: the frontend and LLVM run under the GIL, ptxas in a subprocess it
waits for). `CompileAhead` runs the forwards once "dry" first: Triton calls its cache hook before compiling a
kernel this process has not compiled yet, and the hook records the kernel's specialization and skips the
launch. The records are compiled by a pool of worker processes, which need no GPU (the target is given: a compile
is pure CPU work) and write Triton's on-disk cache; the real capture then finds every kernel there. Kernels
already compiled in this process launch as usual, and so do the modules in `LAUNCHED_MODULES`, whose outputs
(expert ids) later ops index with: a dry forward computes on garbage elsewhere, which no index reads.

The dry forwards must not synchronize with the host on values their kernels produce; the forwards captured in
CUDA graphs cannot, which is where the engine uses this.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Kernels that run for real in a dry forward: their outputs are indices that torch ops read.
LAUNCHED_MODULES = frozenset({"kestrel.kernels.moe_routing"})
MAX_WORKERS = 8


@dataclass(frozen=True)
class KernelSpec:
    """One kernel specialization to compile: where its JITFunction lives and Triton's own serialized
    specialization (signature, constexprs, attributes, options)."""

    module: str
    name: str
    specialization: str


def default_workers() -> int:
    """Worker processes for a machine: its usable cores less one (the engine's), at most MAX_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MAX_WORKERS, cores - 1))


class CompilePool(ProcessPoolExecutor):
    """The compile processes, and when they started and finished their imports (`start_pool`), which the start-up
    statistics report beside each wave's timing."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        self.started = time.monotonic()
        self.imports: list[Future] = []
        # Every compile submitted, by target and kernel specialization: a later wave that records one again waits
        # for it.
        self.compiles: dict[tuple[Any, ...], Future] = {}

    def seconds_to_ready(self) -> float | None:
        """Seconds from the pool's start to the last worker's imports done, once all are (None before)."""
        if not self.imports or not all(f.done() and f.exception() is None for f in self.imports):
            return None
        return max(f.result() for f in self.imports) - self.started


# The pool `start_pool_early` started, which the next `start_pool` of the same size takes (one per process: the
# engine builder starts it, the runner it builds takes it).
_early_pool: CompilePool | None = None


def start_pool_early(workers: int) -> None:
    """Start the pool that the next `start_pool(workers)` of this process returns, so that the workers' imports
    (seconds) also overlap what comes before the runner: the tokenizer's load and CUDA's initialisation. A pool
    already started early of another size is shut down."""
    global _early_pool
    if not _early_pool_has(workers):
        discard_early_pool()
        _early_pool = start_pool(workers)


def _early_pool_has(workers: int) -> bool:
    return _early_pool is not None and _early_pool._max_workers == workers


def discard_early_pool() -> None:
    """End the pool `start_pool_early` started, if no runner took it (the engine's build failed before)."""
    global _early_pool
    if _early_pool is not None:
        stop_pool(_early_pool, terminate=True)
        _early_pool = None


def stop_pool(pool: Executor, terminate: bool = False) -> None:
    """Shut `pool` down without waiting for it; `terminate`: end its workers now too, since an import or a compile
    under way would otherwise run to its end (holding the program's output) before the worker exits."""
    # The executor's own map of its worker processes: no public way to end them before Python 3.14.
    workers = getattr(pool, "_processes", None) if terminate else None
    processes = list(workers.values()) if workers else []
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()


def start_pool(workers: int) -> CompilePool | None:
    """A pool of `workers` spawned compile processes (None for 0), each importing Triton at once so that their
    start-up overlaps whatever this process does next (loading weights); the pool `start_pool_early` started, if
    it has as many workers."""
    global _early_pool
    if _early_pool_has(workers):
        pool, _early_pool = _early_pool, None
        return pool
    discard_early_pool()
    if workers < 1:
        return None
    pool = CompilePool(workers)
    try:
        for _ in range(workers):
            pool.imports.append(pool.submit(_import_triton))
    except Exception as e:  # a host that cannot start processes compiles each kernel at its launch instead
        logger.warning("no compile workers (%s): Triton kernels compile when they first launch", e)
        stop_pool(pool, terminate=True)
        return None
    return pool


def _import_triton() -> float:
    """A worker's first task: Triton's compiler and kestrel's Triton kernel modules, which the compiles import.
    Returns when it finished (the monotonic clock, which every process of the host shares)."""
    import pkgutil

    from triton.compiler import compiler  # noqa: F401

    import kestrel.kernels

    for module in pkgutil.iter_modules(kestrel.kernels.__path__):
        if not module.ispkg:
            importlib.import_module(f"kestrel.kernels.{module.name}")
    return time.monotonic()


def compile_spec(spec: KernelSpec, target: tuple[str, int | str, int]) -> float:
    """Compile one specialization for `target` (backend, arch, warp size) into Triton's on-disk cache, as
    `JITFunction.preload` does but without a device; returns the seconds it took. Runs in a worker process."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    began = time.perf_counter()
    fn = getattr(importlib.import_module(spec.module), spec.name)
    data = json.loads(spec.specialization)
    constexprs = {
        tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value) else
        tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
        for key, value in zip(data["constant_keys"], data["constant_vals"])
    }
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {key: convert_to_tuple_if_list(value) for key, value in data["signature"].items()}
    gpu_target = GPUTarget(*target)
    backend = make_backend(gpu_target)
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu_target,
                            options=options.__dict__)
    _build_launcher(kernel, gpu_target)
    return time.perf_counter() - began


def _build_launcher(kernel: Any, target: Any) -> None:
    """Build the kernel's C launcher into Triton's cache too. Otherwise the launching process builds it at the
    kernel's first launch, with the host's C compiler (about 0.4 s, once per distinct launcher source), one after
    another. Best effort: where it cannot be built here (no CUDA driver library to link), the launch builds it."""
    if target.backend != "cuda":
        return
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception as e:  # the launch builds it, and raises there if it must
        logger.debug("launcher of %s not built ahead: %s", kernel.name, e)


@dataclass
class CompileAhead:
    """Context for dry forwards (see the module docstring): `with CompileAhead(pool, target): forward(...)`, then
    `wait()` compiles what they recorded. Without a pool it records nothing and every kernel launches as usual."""

    pool: Executor | None
    target: tuple[str, int | str, int]
    specs: dict[tuple[str, str, str], KernelSpec] = field(default_factory=dict)
    _futures: list[Future] = field(default_factory=list)
    reused: int = 0  # recorded specializations an earlier wave had submitted already
    _previous_hook: Any = None

    def __enter__(self) -> CompileAhead:
        from triton import knobs

        self._previous_hook = knobs.runtime.jit_cache_hook
        if self.pool is not None:
            knobs.runtime.jit_cache_hook = self._record
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._previous_hook

    def _record(self, *, key: Any, repr: str, fn: Any, compile: dict, is_manual_warmup: bool,
                already_compiled: bool) -> bool:
        """Triton's cache hook: True skips the compile and the launch."""
        module = fn.module
        if module in LAUNCHED_MODULES or is_manual_warmup:
            return False
        spec = KernelSpec(module, fn.name, compile["specialization_data"])
        ident = (module, fn.name, spec.specialization)
        if ident not in self.specs:
            self.specs[ident] = spec
            submitted = getattr(self.pool, "compiles", None)
            key = (self.target, *ident)
            future = submitted.get(key) if submitted is not None else None
            if future is None:
                future = self.pool.submit(compile_spec, spec, self.target)
                if submitted is not None:
                    submitted[key] = future
            else:
                self.reused += 1
            self._futures.append(future)
        return True

    def wait(self) -> dict[str, float]:
        """Wait for every recorded compile; the seconds each kernel's compiles took in the workers, by kernel name.
        A failed one is logged and left to compile where it is launched."""
        seconds: dict[str, float] = {}
        for spec, future in zip(self.specs.values(), self._futures):
            try:
                seconds[spec.name] = seconds.get(spec.name, 0.0) + future.result()
            except Exception as e:  # the launch compiles it in this process, and raises there if it must
                logger.warning("ahead-of-capture compile failed (%s); it compiles at its launch", e)
        return seconds


def current_target() -> tuple[str, int | str, int]:
    """This process's Triton target (its active GPU), as `compile_spec` takes it."""
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    return target.backend, target.arch, target.warp_size


def compile_ahead(pool: Executor | None, forwards: list[Callable[[], object]],
                  prefetch: Sequence[Callable[[], object]] = ()) -> dict[str, Any]:
    """Run `forwards` dry, compile what they would have compiled on `pool`, wait: the timing of each phase, and the
    three kernels whose compiles took longest (name, seconds summed over their specializations). `prefetch`: forwards
    of a later wave, run dry after them; their kernels queue behind and this wave does not wait for them (a later
    wave that records one again waits for the same compile). A prefetch forward that fails dry is left."""
    began = time.monotonic()  # the clock of the pool's start and of its workers' imports
    target = current_target() if pool is not None else ("", 0, 0)  # without a pool nothing is compiled for it
    ahead = CompileAhead(pool, target)
    with ahead:
        for forward in forwards:
            forward()
    dry = time.monotonic() - began
    later = CompileAhead(pool, target)
    for forward in prefetch if pool is not None else ():  # without a pool a dry forward would run for real
        try:
            with later:
                forward()
        except Exception as e:  # its kernels compile in their own wave or at their launch
            logger.info("a later wave's forward did not run dry here (%s); its kernels compile in their wave", str(e))
    by_kernel = ahead.wait()
    worker_seconds = sum(by_kernel.values())
    stats: dict[str, Any] = {"kernels": float(len(ahead.specs)), "reused": float(ahead.reused), "dry_s": dry,
                             "wall_s": time.monotonic() - began,
                             "worker_s": worker_seconds, "longest_s": max(by_kernel.values(), default=0.0),
                             "slowest": sorted(by_kernel.items(), key=lambda item: -item[1])[:3]}
    if prefetch:
        stats["prefetched"] = float(len(set(later.specs) - set(ahead.specs)))
    if isinstance(pool, CompilePool):  # where the wave began and the workers were ready, from the pool's start
        stats["began_s"] = began - pool.started
        ready = pool.seconds_to_ready()
        if ready is not None:
            stats["workers_ready_s"] = ready
    logger.info("compiled %d kernel specializations ahead of capture in %.2f s (%.1f s of compile on %s workers)",
                len(ahead.specs), stats["wall_s"], worker_seconds,
                getattr(pool, "_max_workers", "?"))
    return stats
