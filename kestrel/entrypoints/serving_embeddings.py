"""/v1/embeddings (an input, or vLLM's chat form: messages rendered by the chat template): a decoder served for
generation also embeds, by last-token pooling of its final hidden state
(PoolingParams), as vLLM pools a decoder model asked for embeddings; under the pooling runner the checkpoint's
pooling (`ModelConfig.pooler`: last, mean or first token, normalized or not) applies. `run_pooling` runs the
pooling requests of every pooling endpoint."""

from __future__ import annotations

import base64
import contextlib
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.entrypoints.async_engine import submit_all
from kestrel.entrypoints.budgets import ResponseTooLargeError
from kestrel.entrypoints.pooling_tasks import checked_dimensions, embedding_params, refuse_classifier
from kestrel.entrypoints.protocol import EmbeddingChatRequest, EmbeddingData, EmbeddingRequest, EmbeddingResponse
from kestrel.entrypoints.serving import (
    OpenAIServing,
    _merge,
    _Prompt,
    _until_disconnect,
    _usage_info,
)
from kestrel.entrypoints.text_workers import chat_input
from kestrel.outputs import RequestOutput
from kestrel.pooling_params import PoolingParams
from kestrel.request import InvalidRequestError

# Bytes a float takes in a JSON embedding at most ("-0.012345678901234567,"), and in base64 (4/3 of 4 bytes).
_FLOAT_JSON_BYTES = 24
_FLOAT_BASE64_BYTES = 6


class OpenAIServingEmbeddings:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine
        self.model_config = self.engine.core.config.model
        self.hidden_size = int(self.model_config.hf_config.get("hidden_size") or 0)

    async def create_embedding(self, request: EmbeddingRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        serving = self.serving
        serving.check_model(request.model)
        refuse_classifier(self.model_config, "/v1/embeddings", ("/classify", "/pooling"), ("/score", "/rerank"))
        pooling = embedding_params(self.model_config,
                                   checked_dimensions(self.model_config.hf_config, request.dimensions))
        if isinstance(request, EmbeddingChatRequest):
            self._check_size(1, pooling, request.encoding_format)
            prompts = [await _until_disconnect(raw, self._chat_prompt(request))]
        else:
            inputs = request.inputs()
            serving._check_sequences(len(inputs), 1, "input")
            self._check_size(len(inputs), pooling, request.encoding_format)
            prompts = await _until_disconnect(raw, serving._encode_prompts(
                inputs, request.add_special_tokens is not False, request.truncate_prompt_tokens, "input",
                pooling=True))
        request_id = f"embd-{uuid.uuid4().hex}"
        outputs = await _until_disconnect(raw, run_pooling(serving, request_id, [p.token_ids for p in prompts],
                                                           pooling, request.priority or 0, arrival, "input"))
        data = [EmbeddingData(index=i, embedding=encoded(output.pooled, request.encoding_format))
                for i, output in enumerate(outputs)]
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        response = EmbeddingResponse(id=request_id, model=serving.response_model_name(request.model), data=data,
                                     usage=_usage_info(prompt_tokens, 0))
        return JSONResponse(response.model_dump())

    async def _chat_prompt(self, request: EmbeddingChatRequest) -> _Prompt:
        """The messages rendered by the chat template (the server's, or the request's where the server trusts
        request templates), as one prompt to pool."""
        serving = self.serving
        serving.check_request_chat_template(request.chat_template)
        if any(message.has_images for message in request.messages):
            raise InvalidRequestError("messages", "/v1/embeddings takes text messages; image parts are not embedded")
        request.check_continuation()
        chat = chat_input(request.messages, request.message_dicts(), None,
                          add_generation_prompt=request.add_generation_prompt is not False,
                          chat_template=request.chat_template,
                          continue_final_message=bool(request.continue_final_message),
                          template_kwargs=request.chat_template_kwargs)
        truncate = request.truncate_prompt_tokens
        _, count, ids = await serving.text.render_chat(chat, None if truncate else serving.prompt_limit(True))
        return _Prompt(None, serving._fit_prompt(count, ids, truncate, "messages", pooling=True))

    def _check_size(self, num_inputs: int, pooling: PoolingParams, encoding: str | None) -> None:
        """Refuse, before any work, a response larger than --max-response-bytes."""
        limit = self.serving.config.max_response_bytes
        per_float = _FLOAT_BASE64_BYTES if encoding == "base64" else _FLOAT_JSON_BYTES
        size = num_inputs * (pooling.dimensions or self.hidden_size) * per_float
        if limit and size > limit:
            raise ResponseTooLargeError("input", f"{num_inputs} embeddings would make a response of up to {size:,} "
                                      f"bytes, more than this server's limit of {limit:,} (--max-response-bytes); "
                                      "send fewer inputs per request")


async def run_pooling(serving: OpenAIServing, request_id: str, prompts: list[list[int]], pooling: PoolingParams,
                      priority: int, arrival: float, param: str) -> list[RequestOutput]:
    """One engine request per prompt (all or none queued), each to its final output; a refused prompt is an
    error naming `param`, the request field the prompts came from."""
    engine = serving.engine
    engine.check_capacity(len(prompts))
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    streams = submit_all(engine, [(rid, ids_, {"params": pooling, "priority": priority})
                                  for rid, ids_ in zip(ids, prompts)])
    trackers = [serving.metrics.tracker(arrival) for _ in streams]
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        for stream in streams:
            await stream.accepted()
        async with contextlib.aclosing(_merge(streams)) as outputs:
            async for i, output in outputs:
                trackers[i].observe(output)
                finals[i] = output
    except InvalidRequestError as error:
        if error.param in ("prompt", "prompt_token_ids"):
            raise InvalidRequestError(param, str(error)) from None
        raise
    finally:
        for stream in streams:
            await stream.aclose()
        for tracker in trackers:
            tracker.aborted()  # a no-op for the requests that finished
    if any(final is None or final.pooled is None for final in finals):
        raise RuntimeError("a pooling request ended without its pooled output")
    return finals  # type: ignore[return-value]


def encoded(vector: list[float] | None, encoding: str | None) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector or [])
