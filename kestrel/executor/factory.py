"""The executor `distributed_executor_backend` names: the one module that knows every backend, so the executor base
imports none of them."""

from __future__ import annotations

from kestrel.config import EngineConfig
from kestrel.executor.base import Executor, MultiprocExecutor
from kestrel.executor.ray_executor import RayExecutor


def build_executor(config: EngineConfig, eos_token_id: int | None) -> Executor:
    """The executor `distributed_executor_backend` names (mp when none is named)."""
    if config.parallel.distributed_executor_backend == "ray":
        return RayExecutor(config, eos_token_id)
    return MultiprocExecutor(config, eos_token_id)
