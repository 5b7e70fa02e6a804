"""Builds and loads the C kernels of `kernels/cpu/` (`paged_attention.c`, `elementwise.c`, `wna16.c`) with the system C
compiler, one shared library per source.

The shared library goes to a per-user directory (mode 0700) under `tempfile.gettempdir()`, named by a hash of the
source and the headers beside it (`cpu_math.h`), the flags, the compiler (path, size, mtime) and the CPU's model
and flags (`-march=native` code must not run on another CPU): a second process, or a later run, loads the same
file without compiling. Each build writes a
temporary name and `os.replace`s it into place, so processes compiling at the same time never load a half-written
file.

OpenMP: the library is linked against libgomp by soname; torch's wheel has loaded its own libgomp.so.1 by then, so
the loader binds ours to that same runtime and the kernel's parallel regions reuse torch's thread pool instead of
starting a second one. Without OpenMP support the build is retried without it (one thread).

Anything failing (no compiler, a compile error, a load error) gives None, logged once at debug level: the callers
keep their PyTorch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
ELEMENTWISE_SOURCE = Path(__file__).with_name("elementwise.c")
WNA16_SOURCE = Path(__file__).with_name("wna16.c")
# -fno-trapping-math: the kernels never read the floating-point exception flags, and without it GCC keeps the
# selects of a clamp (`x > lo ? x : lo`) as branches, so no loop calling cpu_math.h's exp vectorizes (SiLU-and-multiply
# ran 4x slower than PyTorch's). It changes no value.
BASE_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fno-trapping-math", "-shared", "-fPIC")
OPENMP_FLAGS: tuple[str, ...] = ("-fopenmp",)
COMPILERS: tuple[str, ...] = ("cc", "gcc")


def find_compiler() -> str | None:
    for name in COMPILERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one copy per distinct line, not one per core


def build_key(source: bytes, flags: tuple[str, ...], compiler: str) -> str:
    st = os.stat(compiler)
    ident = "\0".join([compiler, str(st.st_size), str(st.st_mtime_ns), " ".join(flags), _cpu_identity()])
    return hashlib.sha256(source + b"\0" + ident.encode()).hexdigest()[:24]


def _private(directory: Path) -> bool:
    """Ours and writable by nobody else (the system temp directory is shared: a library there is run as code)."""
    st = directory.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def build(source: Path, compiler: str | None, cache_dir: Path | None = None) -> Path | None:
    """The compiled shared library of `source` (compiled now unless cached), or None if it cannot be built."""
    if compiler is None:
        return None
    cache_dir = cache_dir or Path(tempfile.gettempdir()) / f"kestrel-native-{os.getuid()}"
    try:
        # the headers beside the source (cpu_math.h) are part of what is compiled, so part of the key
        text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(cache_dir):
            logger.debug("native kernels: %s is writable by others, not loading code from it", cache_dir)
            return None
        targets = [(flags, cache_dir / f"{source.stem}-{build_key(text, flags, compiler)}.so")
                   for flags in (BASE_FLAGS + OPENMP_FLAGS, BASE_FLAGS)]
    except OSError as err:
        logger.debug("native kernels: %s", err)
        return None
    for _, target in targets:
        if target.exists():
            return target
    for flags, target in targets:
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=cache_dir)
            os.close(fd)
            done = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], capture_output=True,
                                  timeout=120)
            if done.returncode == 0:
                os.replace(tmp, target)
                return target
            logger.debug("native kernels: %s %s failed: %s", compiler, " ".join(flags),
                         done.stderr.decode(errors="replace")[-2000:])
        except (OSError, subprocess.SubprocessError) as err:
            logger.debug("native kernels: %s", err)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
    return None


def load(source: Path = SOURCE, compiler: str | None = None, cache_dir: Path | None = None,
         find: bool = True) -> ctypes.CDLL | None:
    """Build (if needed) and load `source`; `compiler` None with `find` looks for cc / gcc on PATH."""
    if compiler is None and find:
        compiler = find_compiler()
    path = build(source, compiler, cache_dir)
    if path is None:
        logger.debug("native kernels: no library for %s, using the PyTorch paths", source.name)
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as err:
        logger.debug("native kernels: cannot load %s: %s", path, err)
        return None


@functools.cache
def library(source: Path = SOURCE) -> ctypes.CDLL | None:
    """This process's library of `source` (built once; None when it cannot be)."""
    return load(source)


_PAGED_ATTENTION_ARGS = (
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # q, out, k, v, bf16 cache
    ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # blocks, block size, H, H_kv, D
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # query_start_loc, seq_lens, block_tables
    ctypes.c_long, ctypes.c_int, ctypes.c_int,  # table stride, table width, sequences
    ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_float,  # scale, window, k/v scale, cap
    ctypes.c_int,  # threads
)


@functools.cache
def paged_attention_fn() -> ctypes._CFuncPtr | None:
    """`kestrel_paged_attention` of this process's library with its argument types set, or None."""
    lib = library()
    if lib is None:
        return None
    fn = lib.kestrel_paged_attention
    fn.argtypes = _PAGED_ATTENTION_ARGS
    fn.restype = ctypes.c_int
    return fn


def _function(source: Path, name: str, argtypes: tuple, restype=ctypes.c_int) -> ctypes._CFuncPtr | None:
    lib = library(source)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


@functools.cache
def rms_norm_fn() -> ctypes._CFuncPtr | None:
    """`kestrel_rms_norm` (x, residual, weight, out, residual_out, rows, dim, eps, unit_offset, threads), or None."""
    return _function(ELEMENTWISE_SOURCE, "kestrel_rms_norm", (
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int))


@functools.cache
def silu_mul_fn() -> ctypes._CFuncPtr | None:
    """`kestrel_silu_mul` (x, out, rows, inter, threads), or None."""
    return _function(ELEMENTWISE_SOURCE, "kestrel_silu_mul", (
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int))


@functools.cache
def rope_store_kv_fn() -> ctypes._CFuncPtr | None:
    """`kestrel_rope_store_kv` (see elementwise.c for the arguments), or None."""
    p, i, lng = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    return _function(ELEMENTWISE_SOURCE, "kestrel_rope_store_kv", (
        p, lng, p, lng, p, lng,  # q, k, v and their row strides
        p, p, p, lng,  # positions, cos and sin tables, table rows
        p, p, p, i,  # q_out, k_cache, v_cache, bf16 cache
        p, lng, lng, i, i, i, i, i))  # slots, slot count, tokens, heads, kv heads, head size, rotary dim, threads


@functools.cache
def w4_gemv_fn() -> ctypes._CFuncPtr | None:
    """`kestrel_w4_gemv` (x, qweight, scales, zeros, default zero, out, M, K, N, group, threads), or None."""
    p, lng = ctypes.c_void_p, ctypes.c_long
    return _function(WNA16_SOURCE, "kestrel_w4_gemv", (p, p, p, p, ctypes.c_float, p, lng, lng, lng, lng,
                                                       ctypes.c_int))


@functools.cache
def w4_dequant_fn() -> ctypes._CFuncPtr | None:
    """`kestrel_w4_dequant` (qweight, scales, zeros, default zero, out, K, N, group, first column, columns, threads),
    or None."""
    p, lng = ctypes.c_void_p, ctypes.c_long
    return _function(WNA16_SOURCE, "kestrel_w4_dequant", (p, p, p, ctypes.c_float, p, lng, lng, lng, lng, lng,
                                                          ctypes.c_int))
