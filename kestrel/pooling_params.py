"""PoolingParams: a request that returns the model's final hidden state instead of generating (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kestrel.sampling_params import SamplingParams

# How a prompt's final hidden states become one vector: its last token's, the mean over its tokens, its first's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolingParams:
    """Pooling of the final hidden states (after the model's final norm): `pooling_type` LAST (the last token's,
    as vLLM pools a decoder model asked for embeddings), MEAN (over every prompt token) or CLS (the first
    token's); a model with a classification head then applies it. `dimensions`: the first N features only
    (Matryoshka truncation, for models trained for it; the caller checks that), before `normalize` scales the
    vector to unit L2 norm (vLLM's embedding default). `pooling_type` and `normalize` left None take the model's
    pooler settings when the engine admits the request (`with_defaults`), as vLLM's PoolingParams leaves them to
    the model, so `PoolingParams(dimensions=64)` keeps a mean-pooling model's pooling.

    Such a request runs its prompt and ends: the step that completes the prompt samples one greedy token (so it
    rides the step contract like any other request), which nobody reads. MEAN and CLS need the hidden state of
    every prompt token (the first, for CLS), so such a request computes its whole prompt: it reads no cached
    prefix, whose tokens have KV but no hidden states (`needs_every_token`)."""

    normalize: bool | None = None
    dimensions: int | None = None
    pooling_type: str | None = None
    n = 1  # one sequence, as the engine's queue counts them

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)} or None (the model's), got "
                             f"{self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None (the model's), got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1 or None, got {self.dimensions!r}")

    def with_defaults(self, pooling_type: str, normalize: bool) -> PoolingParams:
        """These params with the fields left None set to the model's pooling type and normalization."""
        if self.pooling_type is not None and self.normalize is not None:
            return self
        return replace(self, pooling_type=self.pooling_type or pooling_type,
                       normalize=normalize if self.normalize is None else self.normalize)

    @property
    def needs_every_token(self) -> bool:
        if self.pooling_type is None:
            raise ValueError("PoolingParams.pooling_type is unresolved: the engine sets the model's with "
                             "with_defaults when it admits the request")
        return self.pooling_type != "LAST"

    @staticmethod
    def run_params() -> SamplingParams:
        """The sampling the engine runs a pooling request with: its prompt, then one token."""
        return SamplingParams(max_tokens=1, temperature=SamplingParams.GREEDY_TEMPERATURE, output_kind="final_only")
