"""Worker processes for the serving process's heavy, bounded work (tokenization, grammar compilation).

Unlike a `ProcessPoolExecutor`, a job here can be taken back: one that passes its deadline, or whose caller is
cancelled (its client went away), costs its worker, which is killed (its memory goes back to the host) and
replaced. Jobs are module-level functions, called by name in the worker; each worker runs `initializer` once.

Heavy jobs (a multi-megabyte prompt, say) may hold at most `heavy_limit` workers at once, so with two workers or
more a light job never waits behind heavy ones; a freed worker goes to the oldest light job first.

`processes=0` runs jobs in threads of the serving process instead (tests, and servers that want no extra
processes): a deadline still answers the caller, but the thread runs on.

Workers are forked by the process's fork server (`kestrel.fork_server`), not spawned: it imports each pool's
`preload` modules once, so a worker, and the replacement of a killed one, starts in milliseconds instead of importing
the tokenizer's libraries again (about 5 s of CPU each with transformers). A worker still ends with the serving
process: an idle one at once, a busy one after its job, when it finds its pipe closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from kestrel.fork_server import fork_context, leave_stop_signals_to_the_server

logger = logging.getLogger("kestrel.server")

_PR_SET_PDEATHSIG = 1

class WorkTimeoutError(Exception):
    """A job did not finish within its deadline (its worker, if a process, was replaced)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the work did not finish within {seconds:g} s")
        self.seconds = seconds


class WorkerLostError(Exception):
    """A worker process died while it ran a job (killed from outside, or out of memory)."""


# ----- the worker side ------------------------------------------------------------------------------------

def _end_with_parent() -> None:
    """A worker dies with the serving process, even a killed one (Linux: PR_SET_PDEATHSIG), rather than finishing
    work nobody waits for."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)


def _picklable(error: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception that does not survive the trip is sent as its text
        return RuntimeError(f"{type(error).__name__}: {error}")


def _worker_main(conn: Connection, initializer: Callable[..., None] | None, initargs: tuple[Any, ...],
                 niceness: int) -> None:
    _end_with_parent()
    leave_stop_signals_to_the_server()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the serving process decides what a Ctrl-C does
    if niceness:
        os.nice(niceness)
    try:
        if initializer is not None:
            initializer(*initargs)
    except BaseException as error:  # noqa: BLE001 - reported to the serving process, which names it
        conn.send(("init_error", _picklable(error)))
        return
    conn.send(("ready", None))
    while True:
        try:
            work, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", work(*args))
        except BaseException as error:  # noqa: BLE001 - the caller gets the job's own exception
            reply = ("error", _picklable(error))
        conn.send(reply)


# ----- the serving side -----------------------------------------------------------------------------------

def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass(eq=False)
class _Worker:
    """A worker process and the pipe to it. The pipe is read by one of the pool's threads (a job's reply, a
    start's "ready") while the event loop may kill the worker: its pipe is then closed by whichever of the two
    finishes last, never under a thread still reading it (a closed descriptor's number goes to the next pipe
    opened, a replacement worker's, whose replies that thread would then read)."""

    process: Any
    conn: Connection
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _readers: int = 0
    _killed: bool = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        """The pipe, for a thread that talks to the worker; WorkerLostError once the worker is killed or gone."""
        with self._lock:
            if self._killed:
                raise WorkerLostError("the worker process was killed")
            self._readers += 1
        try:
            yield self.conn
        except (EOFError, OSError) as error:
            raise WorkerLostError(f"a worker process (exit code {self.process.exitcode}) died during the "
                                  "work") from error
        finally:
            with self._lock:
                self._readers -= 1
                if self._killed and not self._readers:
                    self.conn.close()

    def call(self, work: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
        """Runs in one of the pool's threads: the transfer of a large result does not hold the event loop."""
        with self.reading() as conn:
            conn.send((work, args))
            return conn.recv()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
        with self._lock:
            self._killed = True
            if not self._readers:
                self.conn.close()


class WorkerPool:
    def __init__(self, processes: int, initializer: Callable[..., None] | None = None,
                 initargs: tuple[Any, ...] = (), *, name: str = "worker", niceness: int = 5,
                 heavy_limit: int | None = None, preload: tuple[str, ...] = ()) -> None:
        """`niceness`: batch work runs below the serving process's priority, so the event loop and the engine get
        the cores first. `heavy_limit`: the most workers heavy jobs may hold (default: all but half of them).
        `preload`: modules the fork server imports once for every worker (the initializer's heavy imports)."""
        if processes < 0:
            raise ValueError(f"processes={processes}: expected 0 (threads) or more")
        self.processes = processes
        self.name = name
        self._initializer = initializer
        self._initargs = initargs
        self._niceness = niceness
        self.heavy_limit = heavy_limit if heavy_limit is not None else max(1, processes - processes // 2)
        self._context = fork_context(((initializer.__module__, *preload) if initializer is not None else preload)
                                     if processes else ())
        # A thread per running job waits on its worker's pipe, another per restarting worker on its start; thread
        # mode runs the jobs themselves (several at once).
        self._threads = ThreadPoolExecutor(max(2 * processes + 1, 4), thread_name_prefix=f"kestrel-{name}")
        self._workers: set[_Worker] = set()  # every live worker: idle, busy or starting
        self._idle: list[_Worker] = []
        self._light_waiters: deque[asyncio.Future[_Worker]] = deque()
        self._heavy_waiters: deque[asyncio.Future[_Worker]] = deque()
        self._heavy_running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.replaced = 0  # workers killed for a deadline or a cancelled caller, and started again

    # ----- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> WorkerPool:
        """Start every worker and wait until each ran its initializer (an initializer's failure is raised)."""
        workers = [self._spawn() for _ in range(self.processes)]
        for worker in workers:
            self._wait_ready(worker)
            self._idle.append(worker)
        return self

    def _spawn(self) -> _Worker:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_worker_main, name=f"kestrel-{self.name}", daemon=True,
                                        args=(theirs, self._initializer, self._initargs, self._niceness))
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        self._workers.add(worker)
        return worker

    def _kill(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.discard(worker)

    def _wait_ready(self, worker: _Worker) -> None:
        try:
            with worker.reading() as conn:
                kind, error = conn.recv()
        except WorkerLostError as lost:
            raise WorkerLostError(f"a worker process exited while starting (exit code "
                                  f"{worker.process.exitcode})") from lost
        if kind == "init_error":
            self._kill(worker)
            raise error

    def close(self) -> None:
        """End every worker now, the busy and starting ones too: nothing they do is awaited any more."""
        self._closed = True
        for worker in list(self._workers):
            self._kill(worker)
        self._idle.clear()
        for waiter in (*self._light_waiters, *self._heavy_waiters):
            waiter.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ----- jobs --------------------------------------------------------------------------------------

    async def run(self, work: Callable[..., Any], *args: Any, timeout: float | None = None,
                  heavy: bool = False) -> Any:
        """`work(*args)` in a worker; `timeout` counts from now, the wait for a free worker included."""
        if self._closed:
            raise RuntimeError(f"the {self.name} pool is closed")
        loop = asyncio.get_running_loop()
        if self.processes == 0:
            job = loop.run_in_executor(self._threads, work, *args)
            try:
                async with asyncio.timeout(timeout):
                    return await job
            except TimeoutError:
                raise WorkTimeoutError(timeout or 0.0) from None
        self._loop = loop
        deadline = None if timeout is None else loop.time() + timeout
        acquiring = asyncio.ensure_future(self._acquire(heavy))
        try:
            async with asyncio.timeout(timeout):
                worker = await asyncio.shield(acquiring)
        except TimeoutError:
            self._abandon(acquiring, heavy)
            raise WorkTimeoutError(timeout or 0.0) from None
        except asyncio.CancelledError:
            self._abandon(acquiring, heavy)
            raise
        call = loop.run_in_executor(self._threads, worker.call, work, args)
        call.add_done_callback(_consume)  # a job taken back still ends (its worker killed): nobody reads it
        try:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            async with asyncio.timeout(remaining):
                kind, value = await asyncio.shield(call)
        except TimeoutError:
            self._replace(worker, heavy)
            raise WorkTimeoutError(timeout or 0.0) from None
        except asyncio.CancelledError:
            self._replace(worker, heavy)
            raise
        except WorkerLostError:
            self._replace(worker, heavy)
            raise
        self._release(worker, heavy)
        if kind == "error":
            raise value
        return value

    async def _acquire(self, heavy: bool) -> _Worker:
        if self._idle and (not heavy or self._heavy_running < self.heavy_limit):
            if heavy:
                self._heavy_running += 1
            return self._idle.pop()
        waiter: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
        (self._heavy_waiters if heavy else self._light_waiters).append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a worker just as the caller went away
                self._release(waiter.result(), heavy)
            with contextlib.suppress(ValueError):
                (self._heavy_waiters if heavy else self._light_waiters).remove(waiter)
            raise

    def _abandon(self, acquiring: asyncio.Future[_Worker], heavy: bool) -> None:
        """The caller left (its deadline, or cancelled) while it waited for a worker; a worker handed to it in
        that same turn goes back to the pool. (The acquisition is a task of its own, shielded, under
        `asyncio.timeout`: Python 3.11's `wait_for` returns a result that arrives with the cancellation, and
        swallows the cancellation.)"""
        def give_back(task: asyncio.Future[_Worker]) -> None:
            if not task.cancelled() and task.exception() is None:
                self._release(task.result(), heavy)

        acquiring.cancel()
        acquiring.add_done_callback(give_back)

    def _release(self, worker: _Worker, heavy: bool) -> None:
        if heavy:
            self._heavy_running -= 1
        self._hand_over(worker)

    def _hand_over(self, worker: _Worker) -> None:
        """A free worker goes to the oldest light job, else to the oldest heavy one the limit allows, else idles."""
        if self._closed:
            self._kill(worker)
            return
        while self._light_waiters:
            waiter = self._light_waiters.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        while self._heavy_waiters and self._heavy_running < self.heavy_limit:
            waiter = self._heavy_waiters.popleft()
            if not waiter.done():
                self._heavy_running += 1
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    def _replace(self, worker: _Worker, heavy: bool) -> None:
        """Kill a worker whose job was taken back and start another; it joins the pool once initialized. A heavy
        job's worker counts against heavy_limit until its replacement joins: else heavy jobs that keep passing
        their deadline would take every worker in turn, all of them restarting while light jobs wait."""
        self._kill(worker)
        self.replaced += 1
        if self._closed:
            return
        loop = self._loop
        assert loop is not None
        replacement = self._spawn()

        def wait_ready() -> None:
            try:
                self._wait_ready(replacement)
            except BaseException as error:  # noqa: BLE001 - logged; the pool runs on one worker short
                if not self._closed:
                    logger.error("a %s worker could not be restarted: %s", self.name, error)
                loop.call_soon_threadsafe(self._rejoined, None, heavy)
                return
            loop.call_soon_threadsafe(self._rejoined, replacement, heavy)

        self._threads.submit(wait_ready)

    def _rejoined(self, replacement: _Worker | None, heavy: bool) -> None:
        if heavy:
            self._heavy_running -= 1
        if replacement is not None:
            self._hand_over(replacement)
        elif heavy:  # one worker short: a heavy job waiting may still have room under the limit
            for worker in list(self._idle):
                self._idle.remove(worker)
                self._hand_over(worker)
