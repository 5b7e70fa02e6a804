"""Process settings of a CPU engine: torch's thread count, and glibc malloc kept from returning large blocks to
the kernel between steps.

Threads: each op of a step waits for its slowest thread, so one thread descheduled by other work stalls them
all; the default leaves one usable core to the engine loop, the tokenizer and whatever else shares the machine.

Memory: a step allocates and frees the same large tensors every layer (gathered K/V blocks, GEMM outputs). glibc
serves blocks above its mmap threshold with fresh mappings and returns freed heap tops past its trim threshold,
so each such allocation page-faults its memory in again: on the development machine, batch-64 decode attention
of kestrel-tiny spent ~80% of its time there (6.1 ms a call, 1.2 ms with the thresholds raised). Raising both
thresholds (as an LD_PRELOADed tcmalloc would, which vLLM's CPU backend asks for) keeps the blocks in the heap for
reuse; freed memory is then returned only once more than `TRIM_THRESHOLD` of it sits at the heap's top.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h) and the values set.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit hosts (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30

_malloc_tuned: bool | None = None


def threads_for_cpu_steps(requested: int | None) -> None:
    """`requested` torch threads, else the cores this process may use less one."""
    threads = requested if requested is not None else max(1, len(os.sched_getaffinity(0)) - 1)
    if torch.get_num_threads() != threads:
        logger.info("torch CPU threads %d -> %d", torch.get_num_threads(), threads)
        torch.set_num_threads(threads)


def keep_freed_memory_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where the C library has no mallopt."""
    global _malloc_tuned
    if _malloc_tuned is None:
        _malloc_tuned = False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is not None:
            _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        logger.info("malloc thresholds for CPU steps: %s", "raised" if _malloc_tuned else "unchanged (no mallopt)")
    return _malloc_tuned


def configure_cpu_process(requested_threads: int | None, set_threads: bool) -> None:
    """What a CPU engine sets up before loading: the malloc thresholds, and with `set_threads` the thread count."""
    keep_freed_memory_in_heap()
    if set_threads:
        threads_for_cpu_steps(requested_threads)
