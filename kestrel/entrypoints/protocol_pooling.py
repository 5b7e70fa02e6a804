"""The pooling endpoints' request and response schemas, in vLLM's shapes: /pooling (the pooled vectors), /score
(text_1 against text_2), /rerank (Jina / Cohere: a query against documents) and /classify. Built on
`protocol.py`'s strict base and types, as strictly parsed: unknown fields are refused by name."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from kestrel.entrypoints.protocol import Int, PromptInput, UsageInfo, _Request

Texts = str | Annotated[list[str], Field(min_length=1)]


class _PoolingInputRequest(_Request):
    model: str | None = None
    input: PromptInput
    truncate_prompt_tokens: Annotated[Int, Field(ge=1)] | None = None  # vLLM's: keep the input's last N tokens
    add_special_tokens: bool | None = True
    priority: Int | None = None  # lower first, under --scheduling-policy priority
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text or token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(p, int) for p in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


# ----- /pooling -----------------------------------------------------------------------------------------

class PoolingRequest(_PoolingInputRequest):
    """vLLM's /pooling: each input's pooled output as the model's pooler makes it (an embedding, or a
    classifier's label logits)."""

    encoding_format: Literal["float", "base64"] | None = "float"


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str  # base64: the little-endian float32 bytes


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: UsageInfo


# ----- /classify ----------------------------------------------------------------------------------------

class ClassificationRequest(_PoolingInputRequest):
    """vLLM's /classify: each input's label probabilities (softmax over the labels; sigmoid for one label)."""


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


# ----- /score -------------------------------------------------------------------------------------------

class ScoreRequest(_Request):
    """vLLM's /score: `text_1` against each of `text_2` (one text each: one pair; one against many: a pair each;
    two lists of equal length: pairs by position)."""

    model: str | None = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: Annotated[Int, Field(ge=1)] | None = None
    priority: Int | None = None
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


# ----- /rerank ------------------------------------------------------------------------------------------

class RerankRequest(_Request):
    """Jina's and Cohere's rerank request, as vLLM serves it: `top_n` 0 or left out returns every document."""

    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: Annotated[Int, Field(ge=0)] | None = None
    return_documents: bool | None = True
    truncate_prompt_tokens: Annotated[Int, Field(ge=1)] | None = None
    priority: Int | None = None
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
