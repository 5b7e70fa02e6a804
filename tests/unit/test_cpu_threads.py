"""worker/cpu_runtime.py: `cpu_threads`, a CPU engine's torch threads (one config field with its generated
`--cpu-threads` flag; the default leaves one usable core to the engine loop), and the malloc thresholds."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel import LLM
from kestrel.config import ConfigError, EngineConfig
from kestrel.entrypoints.cli import build_parser
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.worker.cpu_runtime import keep_freed_memory_in_heap, threads_for_cpu_steps


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_leaves_one_core(restore_threads) -> None:
    threads_for_cpu_steps(None)
    assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) - 1)
    threads_for_cpu_steps(3)
    assert torch.get_num_threads() == 3


def test_engine_applies_the_field(tmp_path, restore_threads) -> None:
    write_tiny_checkpoint(str(tmp_path), arch="llama", seed=0)
    torch.set_num_threads(2)
    LLM(str(tmp_path), device="cpu", cpu_threads=1, max_model_len=64)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_values_are_refused(tmp_path, value) -> None:
    write_tiny_checkpoint(str(tmp_path), arch="llama", seed=0)
    with pytest.raises(ConfigError, match="cpu_threads"):
        EngineConfig.from_kwargs(str(tmp_path), cpu_threads=value)


def test_refused_with_a_cuda_device(tmp_path) -> None:
    write_tiny_checkpoint(str(tmp_path), arch="llama", seed=0)
    with pytest.raises(ConfigError, match="cpu_threads"):
        EngineConfig.from_kwargs(str(tmp_path), device="cuda", cpu_threads=2)


def test_cli_flag_is_generated() -> None:
    args = build_parser().parse_args(["generate", "--cpu-threads", "3", "--prompt", "x"])
    assert args.cpu_threads == 3


def test_malloc_thresholds_are_raised_once() -> None:
    """glibc (this machine's C library) accepts both; a second call changes nothing."""
    assert keep_freed_memory_in_heap() is True
    assert keep_freed_memory_in_heap() is True
