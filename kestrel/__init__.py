"""kestrel: a fast LLM inference and serving engine."""

from typing import Any

from kestrel.config import ConfigError
from kestrel.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kestrel.pooling_params import PoolingParams
from kestrel.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "AsyncEngineArgs", "SamplingParams", "RequestOutputKind", "BeamSearchParams",
           "PoolingParams", "RequestOutput", "CompletionOutput", "PoolingRequestOutput", "PoolingOutput",
           "EmbeddingRequestOutput", "EmbeddingOutput", "ClassificationRequestOutput", "ClassificationOutput",
           "ScoringRequestOutput", "ScoringOutput", "ConfigError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; importing it lazily keeps the pure-Python engine modules light to import.
    if name == "LLM":
        from kestrel.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from kestrel.entrypoints.async_llm import AsyncLLM

        return AsyncLLM
    if name == "AsyncEngineArgs":
        from kestrel.entrypoints.async_llm import AsyncEngineArgs

        return AsyncEngineArgs
    raise AttributeError(f"module 'kestrel' has no attribute {name!r}")
