"""`kestrel.AsyncLLM`: the engine for asyncio applications, in vLLM's shape.

    llm = AsyncLLM("/models/llama", max_model_len=4096)          # the engine arguments of LLM(...)
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs("/models/llama", max_model_len=4096))   # vLLM's spelling
    async for output in llm.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(output.outputs[0].delta_text, end="")               # or .text: cumulative
    await llm.abort("r2")
    llm.shutdown()

The engine runs in a thread of this process (the same AsyncEngine the OpenAI server runs on); `generate` is an
async iterator of RequestOutput, one per engine step that produced tokens for the request (`output_kind=
"final_only"` in the SamplingParams: the finished output alone; `"delta"`: each output holds only what its step
added, and outputs a slow reader has not taken yet are joined). Leaving the iteration early, or cancelling the
task that iterates, aborts the request and frees its KV cache; `abort(request_id)` from elsewhere ends the reader's
iteration with the final output (finish_reason "abort", what was generated so far), as vLLM's does.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kestrel.entrypoints.async_engine import AsyncEngine, EngineDeadError
from kestrel.entrypoints.llm import cut_to_params, prompt_media, tokenize_prompt
from kestrel.entrypoints.server_config import check_log_requests
from kestrel.inputs import cache_salt
from kestrel.outputs import RequestOutput
from kestrel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncEngineArgs:
    """vLLM's `AsyncEngineArgs`, for `AsyncLLM.from_engine_args`: the model and the engine arguments of
    `AsyncLLM(model, ...)`, checked when the engine is built (an unknown one is refused by name there)."""

    model: str
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __init__(self, model: str, **engine_args: Any) -> None:
        object.__setattr__(self, "model", str(model))
        object.__setattr__(self, "engine_args", dict(engine_args))


class AsyncLLM:
    def __init__(self, model: str, *, max_queued_requests: int | None = None,
                 request_timeout_s: float | None = None, enable_log_requests: bool = False,
                 disable_log_requests: bool = False, **engine_args: Any) -> None:
        """`enable_log_requests`: log each request's id, prompt size and sampling settings as it is submitted
        (`disable_log_requests`, vLLM's older spelling, is the default)."""
        check_log_requests(enable_log_requests, disable_log_requests)
        self.engine = AsyncEngine.from_args(str(model), max_queued_requests=max_queued_requests,
                                            request_timeout_s=request_timeout_s, **engine_args).start()
        self.tokenizer = self.engine.tokenizer
        self.log_requests = enable_log_requests
        # Requests whose prompts are being prepared (tokenized) before they reach the engine, by id: True once an
        # abort asked for them, which then ends them as soon as they are submitted.
        self._preparing: dict[str, bool] = {}

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs) -> AsyncLLM:
        """vLLM's constructor: `AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., max_model_len=...))`."""
        return cls(engine_args.model, **engine_args.engine_args)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json settings, used when `generate` gets none."""
        return SamplingParams(**self.engine.generation_defaults.sampling)

    async def generate(self, prompt: str | dict[str, Any], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; `prompt` is text, {"prompt": text} or {"prompt_token_ids": [...]}, either
        dict with "multi_modal_data" for a multimodal model. `priority`: lower first, under
        scheduling_policy='priority'."""
        request_id = request_id or uuid.uuid4().hex
        preparing = request_id not in self._preparing
        if preparing:
            self._preparing[request_id] = False
        try:
            text, token_ids = await asyncio.to_thread(tokenize_prompt, self.tokenizer, prompt)
            token_ids, media = await asyncio.to_thread(prompt_media, self.engine.media, prompt, token_ids)
        finally:
            aborted = self._preparing.pop(request_id, False) if preparing else False
        # a copy: the caller may assign the fields of its own while this request runs
        params = sampling_params.clone() if sampling_params is not None else self.get_default_sampling_params()
        text, token_ids, params = cut_to_params(text, token_ids, media, params, self.engine.max_model_len)
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %r", request_id, len(token_ids), params)
        stream = self.engine.submit(request_id, token_ids, params, text, priority=priority, media=media,
                                    cache_salt=cache_salt(prompt))
        if aborted:  # asked while its prompt was being prepared: it ends at once, as an abort of a live request does
            self.engine.abort(request_id)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def abort(self, request_id: str | list[str]) -> None:
        """End the requests: live ones with their final output (finish_reason "abort"), and one whose prompt is still
        being prepared as soon as it reaches the engine."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if rid in self._preparing:
                self._preparing[rid] = True
            self.engine.abort(rid)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's, for benchmarks that must not reuse one); only while no request
        holds a block: False otherwise."""
        return await asyncio.wrap_future(self.engine.reset_prefix_cache())

    async def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise EngineDeadError("the engine is not running" + (f": {self.engine.error!r}" if self.engine.error
                                                                  else ""))

    @property
    def is_running(self) -> bool:
        return self.engine.is_healthy

    @property
    def errored(self) -> bool:
        return self.engine.error is not None

    async def get_tokenizer(self) -> Any:
        """The engine's tokenizer (a coroutine, as vLLM's AsyncLLM has it)."""
        return self.tokenizer

    def shutdown(self) -> None:
        self.engine.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *_: Any) -> None:
        self.shutdown()
