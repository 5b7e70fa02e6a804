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
