"""`ray`: the workers as Ray actors, one per bundle of a placement group, so the same code runs on one machine
or across a Ray cluster's nodes (pipeline stages on different nodes).

The engine process connects to the running cluster (`ray start --head` / `ray start --address=...`) or, when
there is none, starts a local one. Rank 0's node hosts the process-group store. Calls reach each actor in the
order they are made (Ray runs one caller's calls on an actor in order); only rank 0's replies are awaited,
the others' are checked for errors without waiting.
"""

from __future__ import annotations

import logging
from typing import Any

from kestrel.config import ConfigError, EngineConfig
from kestrel.distributed.executor import Executor, free_port
from kestrel.distributed.worker import Worker, WorkerInfo, WorkerSpec
from kestrel.engine.contracts import ModelRunnerOutput

logger = logging.getLogger(__name__)


class RayWorker:
    """The actor body: a `Worker` started once the actors know rank 0's address."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def start(self, spec: WorkerSpec) -> WorkerInfo | None:
        self.worker = Worker(spec)
        return self.worker.info() if spec.rank == 0 else None

    def call(self, payload: bytes) -> ModelRunnerOutput | None:
        import pickle

        assert self.worker is not None
        result = self.worker.handle(pickle.loads(payload))
        return result if self.worker.rank == 0 else None

    def pid(self) -> int:
        import os

        return os.getpid()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        super().__init__(config)
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        if not ray.is_initialized():
            try:
                ray.init(address="auto", logging_level=logging.WARNING)
            except ConnectionError:
                logger.info("no running Ray cluster found: starting a local one")
                ray.init(logging_level=logging.WARNING)
        gpu = config.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
        if config.device == "cuda" and not gpu:
            raise ConfigError("invalid device='cuda' with distributed_executor_backend='ray': the Ray cluster has "
                              "no GPUs; start its nodes on GPU machines or use device='cpu'")
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        self._remove_pg = remove_placement_group
        ready, _ = ray.wait([self._pg.ready()], timeout=self.timeout_s)
        if not ready:
            self._remove_pg(self._pg)
            raise ConfigError(f"invalid tensor_parallel_size x pipeline_parallel_size = {self.world_size}: the Ray "
                              f"cluster cannot place {self.world_size} workers of {bundle} (it has "
                              f"{ray.cluster_resources()}); add nodes or use fewer ranks")
        actor_cls = ray.remote(RayWorker)
        self._actors = [
            actor_cls.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=(
                PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank))).remote()
            for rank in range(self.world_size)
        ]
        self._pending: list[Any] = []  # refs of calls not yet seen to succeed (errors surface from them)
        try:
            host, port = ray.get(self._actors[0].address.remote(), timeout=self.timeout_s)
            threads = None if gpu else 1
            specs = [WorkerSpec(config, eos_token_id, rank, f"tcp://{host}:{port}", device_index=0,
                                num_threads=threads) for rank in range(self.world_size)]
            infos = self._get([a.start.remote(spec) for a, spec in zip(self._actors, specs)], "start")
            self.pids = self._get([a.pid.remote() for a in self._actors], "pid")
        except BaseException:
            self.shutdown()
            raise
        self._adopt(infos[0])

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        try:
            return self._ray.get(refs, timeout=self.timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            raise self._fail(f"the workers did not answer ({what}) within distributed_timeout_s="
                             f"{self.timeout_s:g}") from None
        except self._ray.exceptions.RayError as error:
            raise self._fail(f"a worker failed ({what}): {error}") from None

    def _broadcast(self, payload: bytes) -> None:
        refs = [actor.call.remote(payload) for actor in self._actors]
        self._rank0 = refs[0]
        self._pending.extend(refs)

    def _reply(self) -> ModelRunnerOutput:
        ray, rank0 = self._ray, self._rank0
        # Wait for rank 0's reply, but surface any call's failure as soon as it happens.
        while True:
            done, _ = ray.wait(self._pending, num_returns=1, timeout=self.timeout_s)
            if not done:
                raise self._fail(f"rank 0 did not answer (step) within distributed_timeout_s={self.timeout_s:g}")
            (result,) = self._get(done, "step")  # raises if that call failed
            self._pending = [r for r in self._pending if r != done[0]]
            if done[0] == rank0:
                return result

    def _dead_worker(self) -> str | None:
        if not self._pending:
            return None
        done, _ = self._ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        for ref in done:
            try:
                self._ray.get(ref)
            except self._ray.exceptions.RayError as error:
                return f"a worker failed: {error}"
        self._pending = [r for r in self._pending if r not in set(done)]
        return None

    def shutdown(self) -> None:
        for actor in getattr(self, "_actors", []):
            self._ray.kill(actor)
        self._actors = []
        if getattr(self, "_pg", None) is not None:
            self._remove_pg(self._pg)
            self._pg = None
