"""/pooling, /score, /rerank and /classify: the pooling runner's endpoints, in vLLM's request and response shapes.

A classification checkpoint (`*ForSequenceClassification`) is a cross-encoder: /score and /rerank tokenize each
(query, document) pair as one sequence by the tokenizer's pair template and score it by the sigmoid of its one
logit, as transformers' and sentence-transformers' CrossEncoder do. An embedding model is a bi-encoder: both sides
are embedded and scored by cosine similarity, as vLLM scores with an embedding model. /pooling returns what the
pooler makes (an embedding, or a classifier's raw logits); /classify a classifier's label probabilities.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.entrypoints.budgets import ResponseTooLargeError
from kestrel.entrypoints.pooling_tasks import (
    classifier_params,
    cosine,
    embedding_params,
    is_classifier,
    label_probs,
    require_classifier,
    require_cross_encoder,
    score_pairs,
    sigmoid,
)
from kestrel.entrypoints.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from kestrel.entrypoints.serving import OpenAIServing, _until_disconnect, _usage_info
from kestrel.entrypoints.serving_embeddings import encoded, run_pooling
from kestrel.pooling_params import PoolingParams

# Bytes a float takes in a JSON vector at most, and in base64 (4/3 of 4 bytes).
_FLOAT_JSON_BYTES = 24
_FLOAT_BASE64_BYTES = 6


@dataclass(frozen=True)
class PoolingRoute:
    """One endpoint for the app: its paths, the request schema (parsed in a tokenizer worker), the request field
    that holds its large part, the handler (typed for FastAPI) and the response schema."""

    paths: tuple[str, ...]
    schema: type[BaseModel]
    param: str
    endpoint: Callable[[Any, Request], Awaitable[Response]]
    response: type[BaseModel]


def _typed(schema: type[BaseModel], handler: Callable[[Any, Request], Awaitable[Response]],
           name: str) -> Callable[[Any, Request], Awaitable[Response]]:
    """`handler` with the signature FastAPI reads its body schema from."""

    async def endpoint(body: Any, raw: Request) -> Response:
        return await handler(body, raw)

    endpoint.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=schema),
        inspect.Parameter("raw", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)])
    endpoint.__name__ = name
    return endpoint


class OpenAIServingPooling:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine
        self.model_config = self.engine.core.config.model
        self.pooler = self.model_config.pooler
        self.classifier = is_classifier(self.model_config)
        hf = self.model_config.hf_config
        self.width = self.pooler.num_labels if self.classifier else int(hf.get("hidden_size") or 0)
        labels = hf.get("id2label") if isinstance(hf.get("id2label"), dict) else {}
        self.labels = {int(k): str(v) for k, v in labels.items()}

    def routes(self) -> list[PoolingRoute]:
        return [
            PoolingRoute(("/pooling",), PoolingRequest, "input",
                         _typed(PoolingRequest, self.create_pooling, "create_pooling"), PoolingResponse),
            PoolingRoute(("/score", "/v1/score"), ScoreRequest, "text_2",
                         _typed(ScoreRequest, self.create_score, "create_score"), ScoreResponse),
            PoolingRoute(("/rerank", "/v1/rerank", "/v2/rerank"), RerankRequest, "documents",
                         _typed(RerankRequest, self.create_rerank, "create_rerank"), RerankResponse),
            PoolingRoute(("/classify",), ClassificationRequest, "input",
                         _typed(ClassificationRequest, self.create_classify, "create_classify"),
                         ClassificationResponse),
        ]

    # ----- /pooling and /classify ---------------------------------------------------------------------

    def _pooled_params(self) -> PoolingParams:
        return classifier_params(self.model_config) if self.classifier else embedding_params(self.model_config)

    async def _pool_inputs(self, request: PoolingRequest | ClassificationRequest, raw: Request, prefix: str,
                           pooling: PoolingParams) -> tuple[str, list[list[float]], int]:
        """(request id, each input's pooled output, prompt tokens)."""
        serving = self.serving
        inputs = request.inputs()
        serving._check_sequences(len(inputs), 1, "input")
        prompts = await _until_disconnect(raw, serving._encode_prompts(
            inputs, request.add_special_tokens is not False, request.truncate_prompt_tokens, "input", pooling=True))
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        outputs = await _until_disconnect(raw, run_pooling(serving, request_id, [p.token_ids for p in prompts],
                                                           pooling, request.priority or 0, time.monotonic(),
                                                           "input"))
        return request_id, [o.pooled for o in outputs], sum(len(p.token_ids) for p in prompts)

    async def create_pooling(self, request: PoolingRequest, raw: Request) -> Response:
        self.serving.check_model(request.model)
        self._check_size(len(request.inputs()), request.encoding_format)
        request_id, vectors, tokens = await self._pool_inputs(request, raw, "pool", self._pooled_params())
        data = [PoolingData(index=i, data=encoded(v, request.encoding_format)) for i, v in enumerate(vectors)]
        return JSONResponse(PoolingResponse(id=request_id, model=self.serving.response_model_name(request.model),
                                            data=data, usage=_usage_info(tokens, 0)).model_dump())

    def _check_size(self, num_inputs: int, encoding: str | None) -> None:
        """Refuse, before any work, a response larger than --max-response-bytes."""
        limit = self.serving.config.max_response_bytes
        size = num_inputs * self.width * (_FLOAT_BASE64_BYTES if encoding == "base64" else _FLOAT_JSON_BYTES)
        if limit and size > limit:
            raise ResponseTooLargeError("input", f"{num_inputs} pooled outputs would make a response of up to "
                                        f"{size:,} bytes, more than this server's limit of {limit:,} "
                                        "(--max-response-bytes); send fewer inputs per request")

    async def create_classify(self, request: ClassificationRequest, raw: Request) -> Response:
        self.serving.check_model(request.model)
        require_classifier(self.model_config, "/classify")
        request_id, logits, tokens = await self._pool_inputs(request, raw, "classify", self._pooled_params())
        data = []
        for i, row in enumerate(logits):
            probs = label_probs(row)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=self.labels.get(best), probs=probs,
                                           num_classes=len(probs)))
        return JSONResponse(ClassificationResponse(
            id=request_id, model=self.serving.response_model_name(request.model), data=data,
            usage=_usage_info(tokens, 0)).model_dump())

    # ----- /score and /rerank -------------------------------------------------------------------------

    async def _scores(self, pairs: list[tuple[str, str]], truncate: int | None, priority: int, raw: Request,
                      request_id: str, params: tuple[str, str]) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens spent; `params`: the request fields of the two sides."""
        serving = self.serving
        if self.classifier:
            require_cross_encoder(self.model_config, "/classify")
            serving._check_sequences(len(pairs), 1, params[1])
            limit = None if truncate else serving.prompt_limit(pooling=True)
            counted = await _until_disconnect(raw, serving.text.encode_pairs(pairs, limit, params[1]))
            prompts = [serving._fit_prompt(count, ids, truncate, params[1], pooling=True) for count, ids in counted]
            outputs = await _until_disconnect(raw, run_pooling(serving, request_id, prompts, self._pooled_params(),
                                                               priority, time.monotonic(), params[1]))
            return [sigmoid(o.pooled[0]) for o in outputs], sum(map(len, prompts))
        # A bi-encoder: both sides embedded (each distinct text once), scored by cosine similarity.
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        serving._check_sequences(len(texts), 1, params[1])
        prompts = await _until_disconnect(raw, serving._encode_prompts(texts, True, truncate, params[1],
                                                                       pooling=True))
        pooling = PoolingParams(normalize=True, pooling_type=embedding_params(self.model_config).pooling_type)
        outputs = await _until_disconnect(raw, run_pooling(serving, request_id, [p.token_ids for p in prompts],
                                                           pooling, priority, time.monotonic(), params[1]))
        vectors = {text: output.pooled for text, output in zip(texts, outputs)}
        scores = [cosine(vectors[first], vectors[second]) for first, second in pairs]
        return scores, sum(len(p.token_ids) for p in prompts)

    async def create_score(self, request: ScoreRequest, raw: Request) -> Response:
        self.serving.check_model(request.model)
        pairs = score_pairs(request.text_1, request.text_2)
        request_id = f"score-{uuid.uuid4().hex}"
        scores, tokens = await self._scores(pairs, request.truncate_prompt_tokens, request.priority or 0, raw,
                                            request_id, ("text_1", "text_2"))
        data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
        return JSONResponse(ScoreResponse(id=request_id, model=self.serving.response_model_name(request.model),
                                          data=data, usage=_usage_info(tokens, 0)).model_dump())

    async def create_rerank(self, request: RerankRequest, raw: Request) -> Response:
        self.serving.check_model(request.model)
        request_id = f"rerank-{uuid.uuid4().hex}"
        pairs = [(request.query, document) for document in request.documents]
        scores, tokens = await self._scores(pairs, request.truncate_prompt_tokens, request.priority or 0, raw,
                                            request_id, ("query", "documents"))
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        keep_text = request.return_documents is not False
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i]) if keep_text else None)
                   for i in order]
        response = RerankResponse(id=request_id, model=self.serving.response_model_name(request.model),
                                  usage=RerankUsage(total_tokens=tokens), results=results)
        return JSONResponse(response.model_dump(exclude_none=True))
