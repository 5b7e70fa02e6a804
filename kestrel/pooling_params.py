"""PoolingParams: a request that returns the model's final hidden state instead of generating (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.sampling_params import SamplingParams


@dataclass(frozen=True)
class PoolingParams:
    """Last-token pooling of the final hidden state (after the model's final norm), as vLLM pools a decoder model
    asked for embeddings; `dimensions`: its first N features only (Matryoshka truncation, for models trained for
    it; the caller checks that), before `normalize` scales it to unit L2 norm (vLLM's embedding default).

    Such a request runs its prompt and ends: the step that completes the prompt samples one greedy token (so it
    rides the step contract like any other request), which nobody reads."""

    normalize: bool = True
    dimensions: int | None = None
    n = 1  # one sequence, as the engine's queue counts them

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1 or None, got {self.dimensions!r}")

    @staticmethod
    def run_params() -> SamplingParams:
        """The sampling the engine runs a pooling request with: its prompt, then one token."""
        return SamplingParams(max_tokens=1, temperature=SamplingParams.GREEDY_TEMPERATURE, output_kind="final_only")
