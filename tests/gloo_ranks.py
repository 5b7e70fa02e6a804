"""Gloo ranks for the tests that compare a sharded model with one process: each rank writes its results under a
shared directory, and a rank that fails writes its traceback there too. The ranks fork from the test process's fork
server (`kestrel.fork_server`, which tests/conftest.py asks to import torch and kestrel's worker), not spawned: each
would import them again."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from kestrel.fork_server import fork_context

FAIL_GRACE_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_entry(work: Callable[[int, list[int], str], None], rank: int, ports: list[int], root: str) -> None:
    """A rank's process: `work`, its traceback saved on failure. Every result is on disk when it returns, and the
    rank then leaves without the interpreter's teardown, which once aborted a rank in gloo's thread destructors
    ("terminate called without an active exception", exit code -6) after its work was done."""
    try:
        work(rank, ports, root)
    except BaseException:
        (Path(root) / f"error-rank{rank}.txt").write_text(traceback.format_exc())
        raise
    os._exit(0)


def run_ranks(work: Callable[[int, list[int], str], None], world: int, num_groups: int, root: Path,
              timeout_s: float, attempts: int = 3) -> None:
    """`world` ranks running `work(rank, ports, root)`, with a free port for each of `num_groups`
    successive process groups; fails with the first rank's traceback, or the exit codes. A port found free can
    be taken by another process before rank 0's store binds it; such a run is repeated on fresh ports."""
    for attempt in range(attempts):
        procs = _start_and_join(work, world, [free_port() for _ in range(num_groups)], root, timeout_s)
        errors = sorted(root.glob("error-rank*.txt"))
        if attempt + 1 < attempts and any(_lost_port_race(e.read_text()) for e in errors):
            for error in errors:
                error.unlink()
            continue
        assert not errors, errors[0].read_text()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return


def _lost_port_race(traceback_text: str) -> bool:
    return "EADDRINUSE" in traceback_text or "Address already in use" in traceback_text


def _start_and_join(work: Callable[[int, list[int], str], None], world: int, ports: list[int], root: Path,
                    timeout_s: float) -> list[multiprocessing.process.BaseProcess]:
    """The ranks, joined. The first to fail ends the others (after FAIL_GRACE_S, for their own tracebacks: rank
    0's lost port race must be seen to be retried), as does the deadline: `timeout_s` a rank, and at most
    `timeout_s` past the first clean exit. Ranks waiting for a dead peer would otherwise sit in gloo's rendezvous
    until its own timeout (a lost port race cost minutes that way before its retry)."""
    ctx = fork_context()
    procs = [ctx.Process(target=rank_entry, args=(work, rank, ports, str(root)), daemon=True)
             for rank in range(world)]
    deadline = time.monotonic() + timeout_s * world
    try:
        for p in procs:
            p.start()
        running = list(procs)
        while running and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
            running = [p for p in procs if p.exitcode is None]
            if any(p.exitcode not in (None, 0) for p in procs):
                multiprocessing.connection.wait([p.sentinel for p in running], timeout=FAIL_GRACE_S)
                break
            if any(p.exitcode == 0 for p in procs):
                deadline = min(deadline, time.monotonic() + timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return procs
