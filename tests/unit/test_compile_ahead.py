"""Compiling Triton kernels ahead in worker processes (`kestrel.kernels.compile_ahead`), without a GPU: a worker
compiles a specialization, as Triton's cache hook serializes it, for sm_90 into Triton's on-disk cache, and a
second worker compiling the same one finds it there (same cache key across processes); the engine refuses
compile_workers where nothing would use them. The dry forwards and the capture that finds the kernels are in
tests/gpu/test_compile_ahead_gpu.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import serialize_specialization_data

from kestrel.config import ConfigError
from kestrel.kernels.compile_ahead import KernelSpec, compile_spec, default_workers, start_pool

TARGET = ("cuda", 90, 32)


def spec() -> KernelSpec:
    """What the cache hook hands over for scale_kernel(float32*, float32*, n, factor, BLOCK=256), pointers
    16-byte aligned, as Triton serializes it."""
    signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "factor": "fp32", "BLOCK": "constexpr"}
    options = make_backend(GPUTarget(*TARGET)).parse_options({"num_warps": 4, "num_stages": 2})
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    data = serialize_specialization_data("compile_ahead_kernels.scale_kernel", signature, {(4,): 256}, attrs, options,
                                         "test-key")
    return KernelSpec("compile_ahead_kernels", "scale_kernel", data)


def cache_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_worker_compiles_into_the_cache_and_a_second_one_finds_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernel tests' conftest may have set it for this session
    pool = start_pool(2)
    try:
        first = pool.submit(compile_spec, spec(), TARGET).result(timeout=300)
        compiled = cache_files(tmp_path)
        assert any(name.endswith("scale_kernel.cubin") for name in compiled), compiled
        began = time.perf_counter()
        again = pool.submit(compile_spec, spec(), TARGET).result(timeout=300)
        assert time.perf_counter() - began < 60
    finally:
        pool.shutdown()
    assert cache_files(tmp_path) == compiled  # nothing new: the same key, a cache hit
    assert again < first


def test_no_workers_no_pool_and_cpu_refusal() -> None:
    assert start_pool(0) is None
    assert 0 <= default_workers() <= 8
    from kestrel import LLM
    from kestrel.tiny import BUNDLED_MODEL_DIR

    tiny_model_dir = str(BUNDLED_MODEL_DIR)
    with pytest.raises(ConfigError, match="compile_workers"):
        LLM(tiny_model_dir, device="cpu", compile_workers=2)
    with pytest.raises(ConfigError, match="compile_workers"):
        LLM(tiny_model_dir, compile_workers=-1)


def test_a_host_that_cannot_start_workers_gets_no_pool(monkeypatch) -> None:
    """Spawning refused (a restricted container): no pool, and the engine compiles each kernel at its launch."""
    from concurrent.futures import ProcessPoolExecutor

    def refuse(self, *args, **kwargs):
        raise OSError("cannot start a process here")

    monkeypatch.setattr(ProcessPoolExecutor, "submit", refuse)
    assert start_pool(2) is None


def test_a_pool_started_early_is_the_one_the_runner_takes(monkeypatch) -> None:
    """`start_pool_early` (the engine builder, before the tokenizer) starts the pool that the runner's
    `start_pool` of the same size returns, once; a runner wanting another size gets its own, and the early one is
    shut down. Threads stand in for the spawned processes."""
    from concurrent.futures import ThreadPoolExecutor

    from kestrel.kernels import compile_ahead

    class ThreadPool(ThreadPoolExecutor):
        def __init__(self, workers: int) -> None:
            super().__init__(max_workers=workers)
            self.started = time.monotonic()
            self.imports = []
            self.was_shut_down = False

        def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
            self.was_shut_down = True
            super().shutdown(wait=wait, cancel_futures=cancel_futures)

    monkeypatch.setattr(compile_ahead, "CompilePool", ThreadPool)
    monkeypatch.setattr(compile_ahead, "_import_triton", time.monotonic)
    monkeypatch.setattr(compile_ahead, "_early_pool", None)

    compile_ahead.start_pool_early(2)
    early = compile_ahead._early_pool
    compile_ahead.start_pool_early(2)  # the builder's second call keeps it
    assert compile_ahead._early_pool is early
    taken = start_pool(2)
    assert taken is early and not early.was_shut_down
    later = start_pool(2)  # taken once: the next runner of the process gets a pool of its own
    assert later is not early
    for pool in (taken, later):
        pool.shutdown()

    compile_ahead.start_pool_early(2)
    early = compile_ahead._early_pool
    other = start_pool(3)
    assert other is not early and other._max_workers == 3 and early.was_shut_down
    other.shutdown()
    compile_ahead.start_pool_early(2)
    early = compile_ahead._early_pool
    assert start_pool(0) is None and early.was_shut_down and compile_ahead._early_pool is None


def test_the_engine_builder_starts_the_runners_pool_early(monkeypatch) -> None:
    """The builder starts as many workers as the runner of its config would (`compile_worker_count`), and none
    where the model runs on the CPU or in worker processes (their ranks start no pool)."""
    import torch

    from kestrel import ops
    from kestrel.config import EngineConfig
    from kestrel.tiny import BUNDLED_MODEL_DIR
    from kestrel.worker import runner_setup

    started: list[int] = []
    monkeypatch.setattr(ops, "start_pool_early", started.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = str(BUNDLED_MODEL_DIR)
    for kwargs in ({"device": "cuda"}, {"device": "cuda", "compile_workers": 3},
                   {"device": "cuda", "enforce_eager": True}, {"device": "cpu"},
                   {"device": "cuda", "tensor_parallel_size": 2}):
        runner_setup.start_compile_pool_early(EngineConfig.from_kwargs(model, **kwargs))
    assert started == [ops.default_workers(), 3, 0]


def test_a_prefetched_waves_kernels_are_not_waited_for_and_the_next_wave_takes_their_compiles(monkeypatch) -> None:
    """`compile_ahead(pool, forwards, prefetch)`: the later wave's kernels (the capture's, dry in the memory
    profile's wave) queue behind this wave's, which returns without them; the later wave, recording them again,
    waits for those same compiles instead of submitting new ones. A prefetch forward that fails dry is left. The
    forwards call Triton's cache hook as a kernel launch would."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from triton import knobs

    from kestrel.kernels import compile_ahead

    release = threading.Event()
    compiled: list[str] = []

    def compile_spec(spec: KernelSpec, target: tuple) -> float:
        compiled.append(spec.name)
        if spec.name == "capture_kernel":
            assert release.wait(60)
        return 0.01

    def launch(name: str) -> None:
        fn = SimpleNamespace(module="kestrel.kernels.some_module", name=name)
        skipped = knobs.runtime.jit_cache_hook(key=name, repr=name, fn=fn, compile={"specialization_data": name},
                                               is_manual_warmup=False, already_compiled=False)
        assert skipped  # a dry forward launches nothing

    def fails_dry() -> None:
        raise IndexError("a forward this wave's cache cannot run")

    monkeypatch.setattr(compile_ahead, "compile_spec", compile_spec)
    monkeypatch.setattr(compile_ahead, "current_target", lambda: TARGET)
    pool = ThreadPoolExecutor(max_workers=2)
    pool.compiles = {}
    try:
        profile = compile_ahead.compile_ahead(pool, [lambda: launch("profile_kernel")],
                                              prefetch=[lambda: launch("capture_kernel"),
                                                        lambda: launch("profile_kernel"), fails_dry])
        assert profile["kernels"] == 1 and profile["prefetched"] == 1 and profile["reused"] == 0
        pending = pool.compiles[("kestrel.kernels.some_module", "capture_kernel", "capture_kernel")]
        assert not pending.done()  # the profile's wave did not wait for it
        release.set()
        capture = compile_ahead.compile_ahead(pool, [lambda: launch("capture_kernel"), lambda: launch("graph_only")])
        assert pending.done()
        assert capture["kernels"] == 2 and capture["reused"] == 1 and "prefetched" not in capture
        assert sorted(compiled) == ["capture_kernel", "graph_only", "profile_kernel"]  # each compiled once
    finally:
        release.set()
        pool.shutdown()
