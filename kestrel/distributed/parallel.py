"""Process groups and the collectives the sharded model needs, behind one frozen `ParallelContext`.

Ranks are laid out stage-major: global rank = pp_rank * tp_size + tp_rank, so a tensor-parallel group is a
contiguous block of ranks (one node's GPUs in the usual layout) and pipeline neighbours are tp_size apart.
The context is passed explicitly to every layer that communicates; nothing here is a module global (the
default process group that torch.distributed keeps is only used through the handles stored in the context).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in a tp_size x pp_size grid, with its groups. `tp_group` / `pp_group` are None
    when that dimension has size 1 (no communication)."""

    rank: int
    tp_size: int
    pp_size: int
    tp_group: Any = None
    pp_group: Any = None
    world_group: Any = None
    # Mixture-of-experts layers split their experts over the tensor-parallel group, whole experts per rank.
    expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_layers(self, num_layers: int) -> range:
        """The contiguous layers this pipeline stage owns (earlier stages take the remainder)."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))

    # ----- tensor parallel ----------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group, in place."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the tensor-parallel group, in place."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.tp_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every tensor-parallel rank's `tensor` along `dim`, in rank order."""
        if self.tp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    # ----- pipeline parallel --------------------------------------------------------------------------

    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        """Hand hidden states and residual to the same tp rank of the next stage."""
        peer = self.rank + self.tp_size
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=peer)

    def recv_from_prev_stage(self, like: list[tuple[tuple[int, ...], torch.dtype]],
                             device: torch.device) -> list[torch.Tensor]:
        """Receive tensors of the given (shape, dtype) from the same tp rank of the previous stage."""
        peer = self.rank - self.tp_size
        out = []
        for shape, dtype in like:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src=peer)
            out.append(tensor)
        return out

    # ----- whole world --------------------------------------------------------------------------------

    def min_over_world(self, value: int, device: torch.device) -> int:
        """The smallest `value` over every rank (the KV cache block count all ranks can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.world_group)
        return int(t.item())


def single_process() -> ParallelContext:
    """The context of an unsharded model (no groups, every collective a no-op)."""
    return ParallelContext(rank=0, tp_size=1, pp_size=1)


def init_parallel(rank: int, tp_size: int, pp_size: int, init_method: str, backend: str,
                  timeout_s: float, expert_parallel: bool = False) -> ParallelContext:
    """Join the process group of `tp_size * pp_size` ranks at `init_method` ("tcp://host:port") and build
    this rank's tensor- and pipeline-parallel groups. Every rank must call this with the same arguments
    (except `rank`): group creation is itself collective."""
    world = tp_size * pp_size
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    tp_group = pp_group = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, timeout=timeout, backend=backend) if tp_size > 1 else None
        if rank in ranks:
            tp_group = group
    for tp_rank in range(tp_size):
        ranks = list(range(tp_rank, world, tp_size))
        group = dist.new_group(ranks, timeout=timeout, backend=backend) if pp_size > 1 else None
        if rank in ranks:
            pp_group = group
    return ParallelContext(rank=rank, tp_size=tp_size, pp_size=pp_size, tp_group=tp_group, pp_group=pp_group,
                           world_group=dist.group.WORLD, expert_parallel=expert_parallel)


def shutdown_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
