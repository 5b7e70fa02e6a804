"""Token embedding and LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.model.layers.weights import default_weight_loader


class VocabEmbedding(nn.Module):
    """`weight [vocab, hidden]`. With tensor parallelism the vocab rows would be split across ranks;
    one rank holds them all for now."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """Hidden states -> float32 logits. Kept unquantized: it is small next to the decoder and
    sampling is sensitive to its error."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 tie_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight  # the same Parameter: loaded once, under the embedding's name
        else:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=params_dtype),
                                       requires_grad=False)
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied={self.tied}"
