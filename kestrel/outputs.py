"""What the engine hands back to callers: RequestOutput with one CompletionOutput per sample; the offline pooling
API's PoolingRequestOutput and its embedding, classification and scoring forms (vLLM's shapes); SequenceDelta, a
step's tokens of one sequence for a client that builds the outputs itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar


@dataclass(frozen=True)
class Logprob:
    """One candidate token's log probability (vLLM's shape): its rank in the model's distribution (1 = most
    likely) and its text, decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token_id: Logprob} for the sampled token and the top-k candidates.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token (the first has no context: None).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What this output adds to the previous one of the same request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None
    # Under output_kind="delta", where `logprobs` holds only the step's: the sum over every token so far.
    logprob_sum: float | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' logprobs (vLLM's field), when logprobs were asked for."""
        if self.logprobs is None:
            return None
        if self.logprob_sum is not None:
            return self.logprob_sum
        return sum(step[token].logprob for token, step in zip(self.token_ids, self.logprobs) if step and token in step)


def delta_completion(index: int, token_ids: list[int], logprobs: SampleLogprobs | None, start: int, text: str,
                     finish_reason: str | None, stop_reason: int | str | None,
                     earlier_logprob_sum: float) -> CompletionOutput:
    """A sequence's output under output_kind="delta": its tokens from `start` on, their logprobs when asked for
    (`logprobs`: every token's so far), `text` the text they added; text, token_ids and logprobs are the delta
    (the delta_ fields the same), and `earlier_logprob_sum` (the tokens' before `start`) makes the cumulative
    logprob whole."""
    new_ids = token_ids[start:]
    new_logprobs = logprob_sum = None
    if logprobs is not None:
        new_logprobs = logprobs[start:]
        logprob_sum = earlier_logprob_sum + sum(step[token].logprob for token, step in zip(new_ids, new_logprobs)
                                                if step and token in step)
    return CompletionOutput(index=index, text=text, token_ids=new_ids, logprobs=new_logprobs,
                            finish_reason=finish_reason, stop_reason=stop_reason, delta_text=text,
                            delta_token_ids=new_ids, delta_logprobs=new_logprobs, logprob_sum=logprob_sum)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


class SequenceDelta(NamedTuple):
    """What one step added to one sequence (a request with n = 1): an engine core whose client detokenizes and
    builds the RequestOutputs (`EngineCore(deltas=True)`, the engine core process) hands these over instead. (A
    named tuple: one is built per sequence and step on each side of the pipe.)"""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob] | None] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # the whole list so far, when asked for
    metrics: RequestMetrics | None  # with the first tokens, and when finished
    pooled: list[float] | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # A pooling request's pooled final hidden state (vLLM's PoolingRequestOutput data); None for generation.
    pooled: list[float] | None = field(default=None, repr=False)
    # A kestrel extension: the prompt's token count before prompt compression (prompt_token_ids is the compressed
    # prompt's); None when the request asked for no compression.
    original_num_prompt_tokens: int | None = None


@dataclass(frozen=True)
class PoolingOutput:
    """What the model's pooler made of a prompt: an embedding, or a classifier's raw label logits."""

    data: list[float]


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class ClassificationOutput:
    """Label probabilities: softmax over the labels, the sigmoid of a single label's logit."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True)
class ScoringOutput:
    """A pair's score: a cross-encoder's sigmoid of its one logit, or an embedding model's cosine similarity."""

    score: float


PooledT = TypeVar("PooledT", PoolingOutput, EmbeddingOutput, ClassificationOutput, ScoringOutput)


@dataclass(frozen=True)
class PoolingRequestOutput(Generic[PooledT]):
    """One prompt's (or, for a score, one pair's) result of `LLM.encode` / `embed` / `classify` / `score`, in
    vLLM's field order. A bi-encoder score's `prompt_token_ids` are both sides' ids, one after the other, and its
    `num_cached_tokens` the sum of theirs."""

    request_id: str
    outputs: PooledT
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool


@dataclass(frozen=True)
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    pass


@dataclass(frozen=True)
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    pass


@dataclass(frozen=True)
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass
