"""kestrel: a fast LLM inference and serving engine."""

from kestrel.config import ConfigError
from kestrel.entrypoints.llm import LLM
from kestrel.outputs import CompletionOutput, RequestOutput
from kestrel.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "ConfigError"]
__version__ = "0.1.0"
