"""The process's multiprocessing fork server, shared by every pool of worker processes forked from it.

A fork server is a clean process, started once (none of its parent's threads, no device), that imports the
`preload` modules asked for before it starts and then forks each worker: a worker starts in milliseconds instead of
importing its libraries again (torch and kestrel: ~2.5 s of CPU each on a 2-core machine; transformers' tokenizers:
more). A process that runs threads, or CUDA, never forks itself.

multiprocessing keeps one fork server per process, so the modules asked for after it started are not preloaded:
those workers import them after the fork, as spawned ones would. Its workers also get the environment (os.environ)
that the process had when the fork server started, not the one it has when each worker starts.

A process that runs kestrel's functions only (a grammar worker, an executor's rank, forked or spawned) starts
without the program's main module (`start_without_main`): multiprocessing would import it again there, and a script
without an `if __name__ == "__main__":` guard would run its top level in it (an `LLM(...)` built again in every
worker).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import types
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

_CONTEXT = multiprocessing.get_context("forkserver")
_preloaded: set[str] = set()
_handed_out = False  # a pool asked for the context: workers may have been forked


def _ask_preload(preload: tuple[str, ...]) -> None:
    if not set(preload) <= _preloaded:
        _preloaded.update(preload)
        _CONTEXT.set_forkserver_preload(sorted(_preloaded))


def fork_context(preload: tuple[str, ...] = ()) -> BaseContext:
    """The fork server's multiprocessing context, asking it to import `preload` before it forks (if not started)."""
    global _handed_out
    _ask_preload(preload)
    _handed_out = True
    return _CONTEXT


def start_fork_server(preload: tuple[str, ...]) -> None:
    """Start the fork server now, importing `preload` (the modules of the pools to come): a serving process calls
    it before it loads its model, so those imports run beside the load instead of after it."""
    from multiprocessing import forkserver

    _ask_preload(preload)
    forkserver.ensure_running()


def stop_fork_server() -> None:
    """End the fork server now, mid-preload too (a serving process that refuses to start calls it). A fork server
    notices its parent's exit only once its imports are done, and it holds the parent's stdout and stderr until then:
    a caller reading them (a pipe, a test) would wait out those imports, 10-20 s of transformers and xgrammar on a
    busy 2-core machine, after the refusal was printed.

    Left running once a pool has had the context: its workers may be alive, and multiprocessing learns of their exit
    from the fork server (stopped, they would read as ended and outlive their clean-up); the fork server has then
    finished its imports (it forks only after them), so it ends with this process."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # multiprocessing's own process-wide fork server; it has no public stop
    if server._forkserver_pid is None or _handed_out:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(server._forkserver_pid, signal.SIGTERM)
    server._stop()


def leave_stop_signals_to_the_server() -> None:
    """For a process that serves a server's engine (its core process, an executor's rank, a grammar or tokenizer
    worker): a process group of its own. A terminal's Ctrl-C and a `kill` of the server's process group then reach
    the server alone, which drains on them; a drain needs these processes alive until the requests in flight
    finish. They end with the server instead (its pipe closes, or the parent-death signal) and still end on a
    signal sent to them (multiprocessing terminates daemonic workers at exit)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """While it is open, the processes started (a process pool's workers, whose tasks are kestrel functions pickled
    by module and name) get nothing of the program's `__main__`: they neither import the main module again nor run
    an unguarded script's top level."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def start_without_main(process: BaseProcess) -> None:
    """`process.start()` under `main_module_hidden`."""
    with main_module_hidden():
        process.start()
