"""`ray`: the workers as Ray actors, one per bundle of a placement group, so the same code runs on one machine
or across a Ray cluster's nodes (pipeline stages on different nodes).

The engine process connects to the running cluster (`ray start --head` / `ray start --address=...`) or, when
there is none, starts a local one. Rank 0's node hosts the process-group store. Calls reach each actor in the
order they are made (Ray runs one caller's calls on an actor in order); only the reply rank's results are
awaited (rank 0's, or under pipeline parallelism the last stage's first rank's), in call order; the others' are
checked for errors without waiting.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from kestrel.config import ConfigError, EngineConfig
from kestrel.executor.base import Executor, free_port
from kestrel.executor.worker import Worker, WorkerInfo, WorkerSpec, reply_rank

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
        self.replies = spec.rank == reply_rank(spec.config)
        return self.worker.info() if spec.rank == 0 else None

    def call(self, payload: bytes) -> Any:
        import pickle

        assert self.worker is not None
        result = self.worker.handle(pickle.loads(payload))
        return result if self.replies else None

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
        self._reply_refs: deque[Any] = deque()  # the reply rank's refs of the calls not yet read, in call order
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
        self._reply_refs.append(refs[self.reply_rank])
        self._pending.extend(refs)

    def _await_reply(self) -> Any:
        """The reply rank's next result that is an answer (calls that answer nothing return None)."""
        while self._reply_refs:
            ref = self._reply_refs.popleft()
            # Wait for it, but surface any call's failure as soon as it happens.
            while ref in self._pending:
                done, _ = self._ray.wait(self._pending, num_returns=1, timeout=self.timeout_s)
                if not done:
                    raise self._fail(f"rank {self.reply_rank} did not answer (step) within distributed_timeout_s="
                                     f"{self.timeout_s:g}")
                self._get(done, "step")  # raises if that call failed
                self._pending = [r for r in self._pending if r != done[0]]
            (result,) = self._get([ref], "step")
            # The other ranks' calls of this step are done by now too, most often: drop them here, or the list
            # (scanned by every wait) would grow by world_size - 1 refs a step.
            failure = self._dead_worker()
            if failure is not None:
                raise self._fail(failure)
            if result is not None:
                return result
        raise RuntimeError("no worker call is waiting for an answer")

    def _dead_worker(self) -> str | None:
        """A failed call's error, else None; the calls seen to succeed leave the pending list."""
        if not self._pending:
            return None
        done, rest = self._ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        for ref in done:
            try:
                self._ray.get(ref)
            except self._ray.exceptions.RayError as error:
                return f"a worker failed: {error}"
        self._pending = rest
        return None

    def shutdown(self) -> None:
        for actor in getattr(self, "_actors", []):
            self._ray.kill(actor)
        self._actors = []
        if getattr(self, "_pg", None) is not None:
            self._remove_pg(self._pg)
            self._pg = None
