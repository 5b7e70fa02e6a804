"""The serving process's worker pool: jobs run in worker processes (forked by the fork server), a job past its
deadline or whose caller went away costs its worker (killed, replaced), light jobs never wait behind heavy ones,
and workers end with a killed serving process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from kestrel.entrypoints.worker_pool import WorkerLostError, WorkerPool, WorkTimeoutError


def _fail_init() -> None:
    raise ValueError("no tokenizer here")


def _raise(message: str) -> None:
    raise KeyError(message)


def _sleep_then_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a killed child stays a zombie until reaped: count it as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between the open and the read
        return False


@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(2, name="test").start()
    yield pool
    pool.close()


def test_results_and_errors_come_back(pool):
    async def main():
        pids = await asyncio.gather(*(pool.run(_sleep_then_pid, 0.05) for _ in range(4)))
        assert os.getpid() not in pids and len(set(pids)) == 2
        with pytest.raises(KeyError, match="missing"):
            await pool.run(_raise, "missing")
        return await pool.run(_sleep_then_pid, 0)

    assert asyncio.run(main()) > 0


@pytest.mark.serial  # a time bound: run alone, after the rest (`make test`)
def test_a_job_past_its_deadline_costs_its_worker_which_is_replaced(pool):
    async def main():
        before = pool.replaced
        pid = await pool.run(_sleep_then_pid, 0)
        pids = {pid, await pool.run(_sleep_then_pid, 0)}
        started = time.monotonic()
        with pytest.raises(WorkTimeoutError):
            await pool.run(_sleep_then_pid, 30, timeout=0.3)
        assert time.monotonic() - started < 2
        assert pool.replaced == before + 1
        # Both workers serve again, one of them new; the killed one is gone.
        after = set(await asyncio.gather(*(pool.run(_sleep_then_pid, 0.2, timeout=60) for _ in range(2))))
        assert len(after) == 2 and after != pids
        assert sum(not _alive(p) for p in pids) == 1

    asyncio.run(main())


def test_a_cancelled_caller_frees_its_worker(pool):
    async def main():
        before = pool.replaced
        job = asyncio.ensure_future(pool.run(_sleep_then_pid, 30))
        await asyncio.sleep(0.3)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert pool.replaced == before + 1
        assert len(set(await asyncio.gather(*(pool.run(_sleep_then_pid, 0.2, timeout=60) for _ in range(2))))) == 2

    asyncio.run(main())


def test_light_jobs_never_wait_behind_heavy_ones(pool):
    async def main():
        heavy = [asyncio.ensure_future(pool.run(_sleep_then_pid, 1.5, heavy=True)) for _ in range(3)]
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await pool.run(_sleep_then_pid, 0)
        light_wait = time.monotonic() - started
        await asyncio.gather(*heavy)
        return light_wait

    assert asyncio.run(main()) < 1.0  # the heavy jobs hold one worker of two; the light one takes the other


def test_a_heavy_job_past_its_deadline_keeps_its_lane_until_its_worker_is_replaced(pool):
    """Else heavy jobs that keep passing their deadline take every worker in turn, all of them restarting."""
    async def main():
        both = set(await asyncio.gather(*(pool.run(_sleep_then_pid, 0.2) for _ in range(2))))
        with pytest.raises(WorkTimeoutError):
            await pool.run(_sleep_then_pid, 30, timeout=0.3, heavy=True)
        # The killed worker's replacement is still starting: the next heavy job waits for it, a light one runs.
        heavy, light = await asyncio.gather(pool.run(_sleep_then_pid, 0, heavy=True, timeout=60),
                                            pool.run(_sleep_then_pid, 0, timeout=60))
        assert light in both and heavy not in both

    asyncio.run(main())


def test_a_worker_that_dies_is_reported_and_replaced(pool):
    async def main():
        with pytest.raises(WorkerLostError):
            await pool.run(os._exit, 3)
        assert len(set(await asyncio.gather(*(pool.run(_sleep_then_pid, 0.2, timeout=60) for _ in range(2))))) == 2

    asyncio.run(main())


def test_an_initializer_that_fails_is_raised_at_start():
    with pytest.raises(ValueError, match="no tokenizer here"):
        WorkerPool(1, _fail_init).start()


def test_thread_mode_answers_the_deadline():
    pool = WorkerPool(0)

    async def main():
        assert await pool.run(_sleep_then_pid, 0) == os.getpid()
        with pytest.raises(WorkTimeoutError):
            await pool.run(_sleep_then_pid, 1, timeout=0.1)

    asyncio.run(main())
    pool.close()


_SERVING = """
import asyncio, os, sys
from kestrel.entrypoints.worker_pool import WorkerPool

def pid():
    return os.getpid()

if __name__ == "__main__":
    pool = WorkerPool(2, name="orphans").start()
    async def main():
        return sorted(set(await asyncio.gather(*(pool.run(pid) for _ in range(8)))))
    print(" ".join(map(str, asyncio.run(main()))), flush=True)
    sys.stdin.read()
"""


def test_workers_end_with_a_killed_serving_process(tmp_path):
    """SIGKILL gives the serving process no chance to close its pool: its workers (children of the fork server)
    must still go, with the fork server."""
    script = tmp_path / "serving.py"
    script.write_text(_SERVING)
    serving = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        workers = [int(p) for p in serving.stdout.readline().split()]
        assert workers and all(_alive(p) for p in workers)
    finally:
        serving.send_signal(signal.SIGKILL)
        serving.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers)


def test_a_killed_workers_pipe_stays_open_until_its_reader_is_done(pool):
    """The event loop kills a worker while a pool thread still reads its pipe: closing the pipe then would give
    its descriptor's number to the next pipe opened (the replacement's), which that thread would read."""
    async def main():
        replacement_started = pool.replaced
        job = asyncio.ensure_future(pool.run(_sleep_then_pid, 30))
        await asyncio.sleep(0.3)
        (busy,) = [w for w in pool._workers if w not in pool._idle]
        with busy.reading() as conn:  # a second reader, held across the kill
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job
            assert pool.replaced == replacement_started + 1 and not conn.closed
        deadline = time.monotonic() + 10  # the job's own reader ends when it finds the killed worker's pipe at EOF
        while not conn.closed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert conn.closed
        with pytest.raises(WorkerLostError), busy.reading():
            pass
        assert len(set(await asyncio.gather(*(pool.run(_sleep_then_pid, 0.2, timeout=60) for _ in range(2))))) == 2

    asyncio.run(main())


def test_a_caller_that_leaves_as_it_is_handed_a_worker_gives_the_worker_back():
    """The pool hands its one worker to a waiting caller, and in the same turn the caller is cancelled (its client
    went away): the caller ends cancelled (Python 3.11's `wait_for` would run the job anyway, swallowing the
    cancellation), and the worker goes back to the pool."""
    pool = WorkerPool(1, name="test-handover").start()

    async def main():
        held = await pool._acquire(False)
        waiting = asyncio.ensure_future(pool.run(_sleep_then_pid, 0, timeout=60))
        for _ in range(5):
            await asyncio.sleep(0)
        assert pool._light_waiters  # the caller waits for the one worker
        pool._release(held, False)  # handed to the waiting caller...
        waiting.cancel()  # ...which leaves before it can run
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return await pool.run(_sleep_then_pid, 0, timeout=10)

    try:
        assert asyncio.run(main()) > 0
        assert pool._idle and not pool._light_waiters
    finally:
        pool.close()
