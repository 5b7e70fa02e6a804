"""The gloo ranks' harness (tests/gloo_ranks.py): a failed rank ends its peers at once, so a run that must be
repeated (a lost port race) or reported does not first wait out a peer blocked in the rendezvous."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gloo_ranks import _start_and_join, run_ranks

PEER_WAIT_S = 120.0


def _first_fails_others_wait(rank: int, ports: list[int], root: str) -> None:
    if rank == 0:
        raise RuntimeError("rank 0 failed on purpose")
    time.sleep(PEER_WAIT_S)  # a peer blocked on the dead rank, as in gloo's rendezvous


def _every_rank_writes(rank: int, ports: list[int], root: str) -> None:
    (Path(root) / f"rank{rank}.txt").write_text(str(ports))


def test_a_failed_rank_ends_the_ranks_waiting_for_it(tmp_path: Path) -> None:
    start = time.monotonic()
    procs = _start_and_join(_first_fails_others_wait, 3, [0], tmp_path, PEER_WAIT_S)
    # The waiting ranks were killed, not left to finish their wait (or the harness's deadline, far later).
    assert time.monotonic() - start < PEER_WAIT_S / 2
    assert procs[0].exitcode == 1 and all(p.exitcode == -9 for p in procs[1:])
    assert "rank 0 failed on purpose" in (tmp_path / "error-rank0.txt").read_text()


def test_the_first_failure_is_reported_with_its_traceback(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="rank 0 failed on purpose"):
        run_ranks(_first_fails_others_wait, 2, 1, tmp_path, PEER_WAIT_S)


def test_ranks_that_succeed_all_finish(tmp_path: Path) -> None:
    run_ranks(_every_rank_writes, 3, 2, tmp_path, 60)
    assert sorted(p.name for p in tmp_path.glob("rank*.txt")) == ["rank0.txt", "rank1.txt", "rank2.txt"]
