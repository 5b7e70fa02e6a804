"""The pooling endpoints' request and response schemas, in vLLM's shapes: /pooling (the pooled vectors), /score
(text_1 against text_2), /rerank (Jina / Cohere: a query against documents) and /classify. Built on
`protocol.py`'s strict base and types, as strictly parsed: unknown fields are refused by name."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from kestrel.entrypoints.protocol import Int, ListResponse, PoolingInputRequest, _Request

Texts = str | Annotated[list[str], Field(min_length=1)]


# ----- /pooling -----------------------------------------------------------------------------------------

class PoolingRequest(PoolingInputRequest):
    """vLLM's /pooling: each input's pooled output as the model's pooler makes it (an embedding, or a
    classifier's label logits)."""

    encoding_format: Literal["float", "base64"] | None = "float"


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str  # base64: the little-endian float32 bytes


class PoolingResponse(ListResponse):
    data: list[PoolingData]


# ----- /classify ----------------------------------------------------------------------------------------

class ClassificationRequest(PoolingInputRequest):
    """vLLM's /classify: each input's label probabilities (softmax over the labels; sigmoid for one label)."""


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(ListResponse):
    data: list[ClassificationData]


# ----- /score -------------------------------------------------------------------------------------------

class ScoreRequest(_Request):
    """vLLM's /score: `text_1` against each of `text_2` (one text each: one pair; one against many: a pair each;
    two lists of equal length: pairs by position)."""

    model: str | None = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    priority: Int | None = None
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ListResponse):
    data: list[ScoreData]


# ----- /rerank ------------------------------------------------------------------------------------------

class RerankRequest(_Request):
    """Jina's and Cohere's rerank request, as vLLM serves it: `top_n` 0 or left out returns every document."""

    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: Annotated[Int, Field(ge=0)] | None = None
    return_documents: bool | None = True
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
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
