"""A kernel for tests/unit/test_compile_ahead.py, in a module of its own so that a spawned worker imports it."""

import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=ok) * factor, mask=ok)
