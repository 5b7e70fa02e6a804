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


class ThreadPool:
    """Stands in for CompilePool (threads instead of spawned processes): remembers whether it was shut down."""

    def __init__(self, workers: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(max_workers=workers)
        self._max_workers = workers
        self.started = time.monotonic()
        self.imports: list = []
        self.compiles: dict = {}
        self.was_shut_down = False

    def submit(self, fn, *args):
        return self._executor.submit(fn, *args)

    def seconds_to_ready(self) -> float | None:
        return None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.was_shut_down = True
        self._executor.shutdown(wait=wait, cancel_futures=cancel_futures)


@pytest.fixture
def thread_pools(monkeypatch):
    from kestrel.kernels import compile_ahead

    monkeypatch.setattr(compile_ahead, "CompilePool", ThreadPool)
    monkeypatch.setattr(compile_ahead, "_import_triton", time.monotonic)
    monkeypatch.setattr(compile_ahead, "_early_pool", None)
    return compile_ahead


def test_a_pool_started_early_is_the_one_the_runner_takes(thread_pools) -> None:
    """`start_pool_early` (the engine builder, before the tokenizer) starts the pool that the runner's
    `start_pool` of the same size returns, once; a runner wanting another size gets its own, and the early one is
    shut down."""
    compile_ahead = thread_pools
    compile_ahead.start_pool_early(2)
    early = compile_ahead._early_pool
    compile_ahead.start_pool_early(2)  # a second call keeps it
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
    """The builder starts as many workers as the runner of its config would (`compile_worker_count`, the rule both
    read), and none where the model runs on the CPU or in worker processes (their ranks start no pool)."""
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
        with runner_setup.compile_pool_started_early(EngineConfig.from_kwargs(model, **kwargs)):
            pass
    assert started == [ops.default_workers(), 3, 0]


def test_a_refused_build_ends_the_pool_it_started_before_its_tokenizer(thread_pools, monkeypatch) -> None:
    """`kestrel serve`'s builder (`engine_factory.build_engine`) starts the pool before it loads the tokenizer; a
    build refused before its runner took the pool ends it, and nothing is left for the next one."""
    import torch

    from kestrel.config import EngineConfig
    from kestrel.entrypoints import engine_factory
    from kestrel.tiny import BUNDLED_MODEL_DIR

    compile_ahead = thread_pools
    seen = []

    def load_tokenizer(*args, **kwargs):
        seen.append(compile_ahead._early_pool)
        raise ConfigError("no tokenizer here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_factory, "load_tokenizer", load_tokenizer)
    config = EngineConfig.from_kwargs(str(BUNDLED_MODEL_DIR), device="cuda", compile_workers=2)
    with pytest.raises(ConfigError, match="no tokenizer"):
        engine_factory.build_engine(config)
    assert seen and seen[0] is not None and seen[0]._max_workers == 2
    assert seen[0].was_shut_down and compile_ahead._early_pool is None


def test_a_prefetched_waves_kernels_are_not_waited_for_and_the_next_wave_takes_their_compiles(thread_pools,
                                                                                               monkeypatch) -> None:
    """`compile_ahead(pool, forwards, prefetch)`: the later wave's kernels (the capture's, dry in the memory
    profile's wave) queue behind this wave's, which returns without them; the later wave, recording them again,
    waits for those same compiles instead of submitting new ones, a failed one included (left to its launch). A
    prefetch forward that fails dry is left and the rest still run; Triton's hook is restored. The forwards call
    Triton's cache hook as a kernel launch would."""
    import threading
    from types import SimpleNamespace

    from triton import knobs

    compile_ahead = thread_pools
    release = threading.Event()
    compiled: list[str] = []
    launches: list[bool] = []

    def compile_spec(spec: KernelSpec, target: tuple) -> float:
        compiled.append(spec.name)
        if spec.name == "capture_kernel":
            assert release.wait(60)
        if spec.name == "broken_kernel":
            raise RuntimeError("this kernel does not compile")
        return 0.01

    def launch(name: str) -> None:
        fn = SimpleNamespace(module="kestrel.kernels.some_module", name=name)
        launches.append(knobs.runtime.jit_cache_hook(key=name, repr=name, fn=fn, compile={"specialization_data": name},
                                                     is_manual_warmup=False, already_compiled=False))

    def fails_dry() -> None:
        raise IndexError("a forward this wave's cache cannot run")

    monkeypatch.setattr(compile_ahead, "compile_spec", compile_spec)
    monkeypatch.setattr(compile_ahead, "current_target", lambda: TARGET)
    hook = knobs.runtime.jit_cache_hook
    pool = ThreadPool(2)
    try:
        profile = compile_ahead.compile_ahead(pool, [lambda: launch("profile_kernel")],
                                              prefetch=[lambda: launch("capture_kernel"), fails_dry,
                                                        lambda: launch("profile_kernel"),
                                                        lambda: launch("broken_kernel")])
        assert knobs.runtime.jit_cache_hook is hook
        assert launches == [True] * 4  # every dry launch skipped, the ones after the failed forward too
        assert profile["kernels"] == 1 and profile["prefetched"] == 2 and profile["reused"] == 0
        pending = pool.compiles[(TARGET, "kestrel.kernels.some_module", "capture_kernel", "capture_kernel")]
        assert not pending.done()  # the profile's wave did not wait for it
        release.set()
        capture = compile_ahead.compile_ahead(pool, [lambda: launch("capture_kernel"), lambda: launch("graph_only"),
                                                     lambda: launch("broken_kernel")])
        assert pending.done()
        assert capture["kernels"] == 3 and capture["reused"] == 2 and "prefetched" not in capture
        assert sorted(compiled) == ["broken_kernel", "capture_kernel", "graph_only", "profile_kernel"]  # once each
        assert "broken_kernel" not in capture["slowest"] and len(capture["slowest"]) == 2
    finally:
        release.set()
        pool.shutdown()


def test_without_a_pool_no_forward_runs_dry() -> None:
    """No pool, no hook: the forwards run for real, and the prefetch's are not run at all."""
    from kestrel.kernels import compile_ahead

    ran: list[str] = []
    stats = compile_ahead.compile_ahead(None, [lambda: ran.append("forward")], prefetch=[lambda: ran.append("later")])
    assert ran == ["forward"] and stats["kernels"] == 0
