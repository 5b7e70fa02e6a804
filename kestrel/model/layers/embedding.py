"""Token embedding and LM head (optionally tied to the embedding), vocab-parallel under tensor parallelism.

With `tp_size` ranks each holds a contiguous block of ceil(vocab / tp_size) rows (the last block padded with
zero rows): the embedding looks up the ids in its block, zeros the others and sums over the group (one
all-reduce, exact since every id has one owner); the LM head computes its block's logits and all-gathers
them, so the sampler sees the whole vocabulary on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel import ops
from kestrel.distributed.parallel import ParallelContext, single_process
from kestrel.model.layers.weights import copy_checked


class _VocabShard(nn.Module):
    """The rows of `[vocab, hidden]` this rank owns, with a loader that takes them from the full tensor."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None,
                 parallel: ParallelContext | None) -> None:
        super().__init__()
        self.parallel = parallel or single_process()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        tp = self.parallel.tp_size
        self.rows_per_rank = -(-num_embeddings // tp)
        self.vocab_start = self.parallel.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)

    def _new_weight(self, params_dtype: torch.dtype | None) -> nn.Parameter:
        rows = self.num_embeddings if self.parallel.tp_size == 1 else self.rows_per_rank
        weight = nn.Parameter(torch.empty(rows, self.embedding_dim, dtype=params_dtype), requires_grad=False)
        weight.weight_loader = self.weight_loader
        return weight

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not merged; got shard id {shard_id!r}")
        if self.parallel.tp_size == 1:
            copy_checked(param.data, loaded_weight)
            return
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            copy_checked(param.data, loaded_weight)  # raises, naming both shapes
        owned = max(self.vocab_end - self.vocab_start, 0)
        param.data.zero_()
        copy_checked(param.data[:owned], loaded_weight[self.vocab_start: self.vocab_start + owned])


class VocabEmbedding(_VocabShard):
    """`weight [vocab, hidden]` (this rank's rows under tensor parallelism)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, parallel)
        self.weight = self._new_weight(params_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows={self.vocab_start}:{self.vocab_end}"


class LMHead(_VocabShard):
    """Hidden states -> float32 logits. Kept unquantized: it is small next to the decoder and
    sampling is sensitive to its error."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 tie_to: VocabEmbedding | None = None, parallel: ParallelContext | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, parallel)
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight  # the same Parameter: loaded once, under the embedding's name
        else:
            self.weight = self._new_weight(params_dtype)
        self.cpu_packed_weight: torch.Tensor | None = None
        self.processed = False  # process_after_loading has run (model.layers.linear.process_linear_layer)

    def process_after_loading(self) -> None:
        """On the CPU, a float32 head also keeps its weight in oneDNN's layout, as unquantized linears do."""
        self.cpu_packed_weight = ops.pack_linear_weight(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden_states, self.weight, packed=self.cpu_packed_weight).float()
        if self.parallel.tp_size == 1:
            return logits
        return self.parallel.all_gather(logits, dim=-1)[..., : self.num_embeddings]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied={self.tied}"
