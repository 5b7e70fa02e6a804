"""The process's multiprocessing fork server, shared by every pool of worker processes forked from it.

A fork server is a clean process, started once (none of its parent's threads, no device), that imports the
`preload` modules asked for before it starts and then forks each worker: a worker starts in milliseconds instead of
importing its libraries again (torch and kestrel: ~2.5 s of CPU each on a 2-core machine; transformers' tokenizers:
more). A process that runs threads, or CUDA, never forks itself.

multiprocessing keeps one fork server per process, so the modules asked for after it started are not preloaded:
those workers import them after the fork, as spawned ones would. Its workers also get the environment (os.environ)
that the process had when the fork server started, not the one it has when each worker starts.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

_CONTEXT = multiprocessing.get_context("forkserver")
_preloaded: set[str] = set()


def fork_context(preload: tuple[str, ...] = ()) -> BaseContext:
    """The fork server's multiprocessing context, asking it to import `preload` before it forks (if not started)."""
    if not set(preload) <= _preloaded:
        _preloaded.update(preload)
        _CONTEXT.set_forkserver_preload(sorted(_preloaded))
    return _CONTEXT


def start_fork_server(preload: tuple[str, ...]) -> None:
    """Start the fork server now, importing `preload` (the modules of the pools to come): a serving process calls
    it before it loads its model, so those imports run beside the load instead of after it."""
    from multiprocessing import forkserver

    fork_context(preload)
    forkserver.ensure_running()
