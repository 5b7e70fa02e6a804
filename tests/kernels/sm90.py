"""Kernels compiled for sm_90 (the H200) on a machine without a GPU: the PTX and ptxas's register and spill report,
in a process of its own, since the kernel tests' process interprets its kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Arguments the launchers' values make multiples of 16 at the model shapes compiled (Triton's launch-time alignment
# specialization, which lets the weight loads vectorize).
ALIGNED = {"x_ptr", "w_ptr", "s_ptr", "ids_ptr", "inter_ptr", "weights_ptr", "out_ptr", "N", "K", "stride_xm",
           "stride_we", "stride_wn", "stride_im", "stride_om",
           "v_ptr", "v_cache_ptr", "staged_v_ptr", "stride_v", "stride_vcb", "stride_vct", "stride_vch", "stride_sv"}


def compile_sm90(fn, pointers: dict[str, str], ints: list[str], constexprs: dict, num_warps: int,
                 floats: tuple[str, ...] = (), aligned: frozenset[str] = frozenset()) -> tuple[str, str]:
    """(PTX, ptxas -v report) of `fn` compiled for sm_90 without a GPU; `floats`: its fp32 scalar arguments;
    `aligned`: arguments beyond ALIGNED that the launch finds multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**pointers, **{n: "fp32" for n in floats}, **{n: "i32" for n in ints},
                 **{n: "constexpr" for n in constexprs}}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in signature if n in ALIGNED | aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                text=True, check=True).stderr
    return ptx, report


def _ptxas() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def reports(module: str, call: str) -> list[tuple[str, str]]:
    """The (PTX, report) pairs that `module.call` (a call expression returning `compile_sm90` results) gives in a
    process without TRITON_INTERPRET; skips where a GPU runs the real thing or Triton has no NVIDIA backend."""
    if torch.cuda.is_available():
        pytest.skip("compiled and run for real on this GPU by the GPU tests")
    if not os.path.exists(_ptxas()):
        pytest.skip("this Triton has no NVIDIA backend")
    here = Path(__file__).resolve().parent
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    # The test module's own directory and tests/ (its shared helpers) importable, as under pytest.
    code = (f"import json, sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import {module} as t; "
            f"print(json.dumps(t.{call}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=here.parents[1],
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(pair) for pair in json.loads(done.stdout.strip().splitlines()[-1])]
