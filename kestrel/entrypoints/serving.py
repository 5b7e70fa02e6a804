"""The OpenAI endpoints' logic: a parsed request -> engine requests -> a response or SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kestrel.config import StreamingWindowConfig
from kestrel.engine.detokenizer import TokenizerLookups
from kestrel.entrypoints.async_engine import (
    AsyncEngine,
    DeltaJoiner,
    EngineDeadError,
    RequestIdInUseError,
    RequestStream,
    RequestTimeoutError,
    ServerShuttingDownError,
    submit_all,
)
from kestrel.entrypoints.beam_search import search_async
from kestrel.entrypoints.budgets import (
    TEXT_BYTES_PER_TOKEN,
    ResponseBudget,
    ResponseShape,
    check_estimate,
    check_stop_and_bad_words,
    estimate,
)
from kestrel.entrypoints.chat import (
    ContentDelta,
    MarkedToolCallParser,
    ParserEvent,
    ToolArgumentsDelta,
    ToolCallParser,
    ToolCallStart,
    make_tool_parser,
    new_tool_call_id,
    parse_tool_calls,
    special_token_texts,
)
from kestrel.entrypoints.grammar_pool import GrammarCompilePool
from kestrel.entrypoints.logprob_format import LogprobFormatter, join, text_end
from kestrel.entrypoints.media import MediaLimits, MediaProcessor, chat_images
from kestrel.entrypoints.metrics import RequestTracker, ServerMetrics
from kestrel.entrypoints.prompt_compression import PARAM as COMPRESSION_PARAM
from kestrel.entrypoints.prompt_compression import PromptCompressor
from kestrel.entrypoints.protocol import (
    ChatChoice,
    ChatChoiceLogProbs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    UsageInfo,
    capped_max_tokens,
)
from kestrel.entrypoints.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningSplitter,
    count_reasoning_tokens,
    split_reasoning,
    thinking_at_start,
)
from kestrel.entrypoints.server_config import ServerConfig
from kestrel.entrypoints.text_workers import ChatInput, TextWorkers, chat_input
from kestrel.outputs import CompletionOutput, RequestOutput
from kestrel.request import InvalidRequestError, MediaItem, prompt_too_long, truncation_size
from kestrel.sampling_params import (
    BeamSearchParams,
    PromptCompression,
    SamplingParams,
    StructuredOutputsParams,
    ThinkingTags,
)
from kestrel.structured.compile import GrammarSource

T = TypeVar("T")
RequestModel = TypeVar("RequestModel", CompletionRequest, ChatCompletionRequest)
logger = logging.getLogger("kestrel.server")


class ModelNotFoundError(LookupError):
    MAX_ECHO = 100  # characters of the unknown name repeated back: a huge name must not make a huge error body

    def __init__(self, name: str, served: str) -> None:
        shown = name if len(name) <= self.MAX_ECHO else name[: self.MAX_ECHO] + "..."
        super().__init__(f"the model {shown!r} does not exist; this server serves {served!r}")


class ClientDisconnectedError(Exception):
    """The client went away before the response was ready; its requests were aborted."""


@dataclass(frozen=True)
class _OutputRoom:
    """The output tokens a request asks for (0: none named) and the field that asked; `beam`: for a beam search,
    which never runs past the context (nor, with a streaming window, past sinks + window)."""

    tokens: int
    param: str
    beam: bool = False


def _chat_output_room(request: ChatCompletionRequest, beam: bool) -> _OutputRoom:
    if request.max_completion_tokens is not None:
        return _OutputRoom(request.max_completion_tokens, "max_completion_tokens", beam)
    return _OutputRoom(request.max_tokens or 0, "max_tokens", beam)


@dataclass(frozen=True)
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class _Submitted:
    """The engine requests behind one API request (one per prompt) and their trackers."""

    streams: list[RequestStream]
    trackers: list[RequestTracker]
    prompts: list[_Prompt]
    params: SamplingParams
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    model_name: str = ""
    budget: ResponseBudget | None = None
    report_cached: bool = False  # usage.prompt_tokens_details (--enable-prompt-tokens-details)
    original_prompt_tokens: int | None = None  # before prompt compression (usage.original_prompt_tokens)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt: tokens the prefix cache served

    async def abort(self) -> None:
        """End the engine requests now: their outputs are no longer wanted."""
        for stream in self.streams:
            await stream.aclose()


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code)).model_dump()


def sse(data: str) -> str:
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str], metrics: ServerMetrics,
                 text: TextWorkers, config: ServerConfig, grammars: GrammarCompilePool | None = None) -> None:
        """`grammars`: where structured-outputs grammars are checked and compiled (None: the engine has no grammar
        backend, and refuses them)."""
        self.config = config
        self.grammars = grammars
        self.max_logprob_entries = config.max_logprob_entries
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.text = text
        self.model_names = tuple(served_model_names)
        self.model_name = self.model_names[0]
        self.metrics = metrics
        self.compressor: PromptCompressor | None = getattr(engine, "prompt_compressor", None)
        # A multimodal model's processor (None: text only, and image parts are refused) and where images may come
        # from: the engine's allowed path and domains, the server's size, time and pixel limits.
        self.media: MediaProcessor | None = getattr(engine, "media", None)
        engine_config = getattr(getattr(engine, "core", None), "config", None)
        model_config = getattr(engine_config, "model", None)
        # With attention sinks + window the engine runs a sequence past max_model_len: the prompt must fit sinks +
        # window instead, and max_tokens is bounded by --max-streaming-tokens instead of the context.
        self.streaming: StreamingWindowConfig | None = getattr(engine_config, "streaming", None)
        self.media_limits = MediaLimits(getattr(model_config, "allowed_local_media_path", None),
                                        getattr(model_config, "allowed_media_domains", None),
                                        config.media_fetch_timeout, config.max_media_bytes, config.max_image_pixels,
                                        config.max_audio_seconds)
        # A text prompt's special-token texts stay whole when it is compressed.
        self.special_texts = tuple(special_token_texts(self.tokenizer)) if self.compressor is not None else ()

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ModelNotFoundError(name, self.model_name)

    def refuse_speech_to_text(self, endpoint: str) -> None:
        """An encoder-decoder speech model (Whisper) transcribes audio files; it has no text or chat prompts."""
        if self.media is not None and getattr(self.media, "encoder_decoder", False):
            raise InvalidRequestError("model", f"the served model {self.model_name!r} is a speech-to-text model "
                                      f"(Whisper): it does not serve {endpoint}; use /v1/audio/transcriptions or "
                                      "/v1/audio/translations")

    def response_model_name(self, requested: str | None) -> str:
        """The name a response reports: the one the client asked for (one of ours), else the first."""
        return requested if requested is not None else self.model_name

    # ----- /v1/completions ----------------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        request = _with_header_id(request, raw)
        self.check_model(request.model)
        self.refuse_speech_to_text("/v1/completions")
        check_stop_and_bad_words(request, self.config.max_stop_sequences, self.config.max_bad_words)
        beam = request.beam_search_params(self._max_tokens(request.token_limit))
        if beam is not None:
            return await _until_disconnect(raw, self._beam_completion(request, beam))
        params = request.to_sampling_params(self.engine.generation_defaults.sampling)
        self._check_sequences(len(request.prompts()), params.n, "prompt")  # before any tokenizing
        grammar_source = self._grammar_source(params, request.structured_outputs_field)  # its limits, too
        # A client that goes away takes its tokenization with it (the worker is replaced).
        # vLLM's rule: the requested output must fit the context beside each prompt (0 with echo: none asked).
        room = _OutputRoom(0 if request.scores_only else request.token_limit or 0, "max_tokens")
        self._check_output_room(room)
        prompt_inputs, original_tokens = request.prompts(), None
        if params.prompt_compression is not None:
            prompt_inputs, original_tokens = await _until_disconnect(raw, self._compress_prompts(
                prompt_inputs, params.prompt_compression, request.add_special_tokens is not False))
            params = params.replace(prompt_compression=None)
        prompts = await _until_disconnect(raw, self._encode_prompts(
            prompt_inputs, request.add_special_tokens is not False, request.truncate_prompt_tokens,
            room=room))
        grammar = await self._compile_grammar(grammar_source, raw)
        # The response is built from each step's additions (streamed, or joined here): the engine need not copy
        # each output whole at every step.
        params = params.replace(output_kind="delta")
        job = await self._submit(f"cmpl-{_request_id(request)}", prompts, params, arrival, prompt_param="prompt",
                                 logprobs_param="logprobs", priority=request.priority,
                                 structured_param=request.structured_outputs_field,
                                 shape=_completion_shape(request, params, prompts), grammar=grammar,
                                 cache_salt=request.cache_salt)
        job.model_name = self.response_model_name(request.model)
        job.original_prompt_tokens = original_tokens
        if request.echo:
            job.prompts = [_Prompt(self._prompt_text(p, params), p.token_ids) for p in prompts]
        if request.stream:
            return EventStreamResponse(self._completion_stream(request, job), on_close=job.abort)
        finals = await _until_disconnect(raw, self._collect(job))
        if request.scores_only:
            finals = [_without_generation(final) for final in finals]
        fmt = self._formatter(params.logprobs, request.return_tokens_as_token_ids)
        ids = bool(request.return_token_ids)
        choices = []
        for i, (prompt, final) in enumerate(zip(job.prompts, finals)):
            prompt_logprobs = None
            if _reported_prompt_logprobs(request) is not None:
                prompt_logprobs = fmt.prompt_logprobs(final.prompt_logprobs, _reported_prompt_logprobs(request))
            for c in final.outputs:
                prefix = (prompt.text or "") if request.echo else ""
                logprobs = None
                if params.logprobs is not None and request.echo:
                    # Offsets count the tokens' texts, the prompt's special tokens included.
                    echoed = fmt.echoed_prompt(prompt.token_ids, final.prompt_logprobs)
                    logprobs = join(echoed, fmt.completion(c.token_ids, c.logprobs, text_end(echoed)))
                elif params.logprobs is not None:
                    logprobs = fmt.completion(c.token_ids, c.logprobs, len(prefix))
                choices.append(CompletionChoice(index=i * params.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_logprobs,
                                                prompt_token_ids=list(prompt.token_ids) if ids else None,
                                                token_ids=list(c.token_ids) if ids else None))
        response = CompletionResponse(id=job.request_id, created=job.created, model=job.model_name,
                                      choices=choices, usage=_usage(job, finals))
        return _within_budget(job, JSONResponse(response.model_dump()))

    async def _completion_stream(self, request: CompletionRequest, job: _Submitted) -> AsyncIterator[str]:
        n = job.params.n
        offsets: dict[int, int] = {}
        finished: set[int] = set()
        streamed: dict[int, int] = {}  # per choice: the tokens its chunks carried so far
        fmt = self._formatter(job.params.logprobs, request.return_tokens_as_token_ids)
        ids = bool(request.return_token_ids)
        ids_sent: set[int] = set()

        def token_ids(index: int, prompt: _Prompt, delta: list[int]) -> dict[str, list[int]]:
            """With return_token_ids: each chunk's new token ids, and the prompt's on a choice's first chunk."""
            if not ids:
                return {}
            fields = {"token_ids": list(delta)}
            if index not in ids_sent:
                ids_sent.add(index)
                fields["prompt_token_ids"] = list(prompt.token_ids)
            return fields

        def render(choices: list[CompletionChoice]) -> str:
            usage = None
            if request.usage_in_every_chunk:  # the chunk's own choice and prompt so far, as vLLM counts them
                index = choices[0].index
                usage = _usage_of(job, streamed.get(index, 0), prompt_index=index // n)
            return sse(CompletionStreamResponse(id=job.request_id, created=job.created, model=job.model_name,
                                                choices=choices, usage=usage).model_dump_json(exclude_none=True))

        def chunk(choice: CompletionChoice) -> str:
            return _charged(job, render([choice]))

        if job.budget is not None:
            job.budget.framing = len(render([CompletionChoice(index=0, text="")]).encode())

        # With logprobs the echoed prompt waits for its prompt logprobs, which come with the first output.
        echo_later = set(range(len(job.prompts))) if request.echo and job.params.prompt_logprobs is not None else set()
        merged = self._merged(job)  # closed here, not by the interpreter's finalizer, whichever way this ends
        try:
            if request.echo and not echo_later:
                for i, prompt in enumerate(job.prompts):
                    for j in range(n):
                        offsets[i * n + j] = len(prompt.text or "")
                        yield chunk(CompletionChoice(index=i * n + j, text=prompt.text or "",
                                                     **token_ids(i * n + j, prompt, [])))
            async for i, output in merged:
                if request.scores_only:
                    output = _without_generation(output)
                if i in echo_later:
                    echo_later.discard(i)
                    prompt = job.prompts[i]
                    block = fmt.echoed_prompt(prompt.token_ids, output.prompt_logprobs)
                    for j in range(n):
                        offsets[i * n + j] = text_end(block)
                        yield chunk(CompletionChoice(index=i * n + j, text=prompt.text or "", logprobs=block,
                                                     **token_ids(i * n + j, prompt, [])))
                for c in output.outputs:
                    index = i * n + c.index
                    if index in finished or not (c.delta_text or c.delta_token_ids or c.finished):
                        continue
                    streamed[index] = streamed.get(index, 0) + len(c.delta_token_ids)
                    logprobs = None
                    if job.params.logprobs is not None:
                        logprobs = fmt.completion(c.delta_token_ids, c.delta_logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(c.delta_text)
                    if c.finished:
                        finished.add(index)
                    elif not c.delta_text and logprobs is None and not ids:
                        continue  # text held back (a split character or a possible stop string)
                    yield chunk(CompletionChoice(index=index, text=c.delta_text, logprobs=logprobs,
                                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                 **token_ids(index, job.prompts[i], c.delta_token_ids)))
            if request.include_usage_in_stream:
                usage = _usage_of(job, sum(streamed.values()))
                yield sse(CompletionStreamResponse(id=job.request_id, created=job.created, model=job.model_name,
                                                   choices=[], usage=usage).model_dump_json(exclude_none=True))
        except Exception as error:  # the status line is sent: errors can only travel as an event
            await job.abort()
            yield _stream_error(error)
        finally:
            await merged.aclose()
        yield SSE_DONE

    async def _beam_completion(self, request: CompletionRequest, beam: BeamSearchParams) -> Response:
        self._check_sequences(len(request.prompts()), beam.beam_width, "prompt")
        room = _OutputRoom(beam.max_tokens, "max_tokens", beam=True)
        self._check_output_room(room)
        prompts = await self._encode_prompts(request.prompts(), request.add_special_tokens is not False,
                                             request.truncate_prompt_tokens, room=room)
        results = await search_async(self.engine, [p.token_ids for p in prompts], beam, request.priority or 0)
        choices = []
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            prefix = self._prompt_text(prompt, SamplingParams()) if request.echo else ""
            choices += [CompletionChoice(index=i * beam.beam_width + j, text=prefix + seq.text,
                                         finish_reason=seq.finish_reason) for j, seq in enumerate(result.sequences)]
        completion_tokens = sum(len(seq.output_token_ids) for r in results for seq in r.sequences)
        usage = _usage_info(sum(len(p.token_ids) for p in prompts), completion_tokens)
        return JSONResponse(CompletionResponse(id=f"cmpl-{_request_id(request)}", choices=choices, usage=usage,
                                               model=self.response_model_name(request.model)).model_dump())

    # ----- /v1/chat/completions ------------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        request = _with_header_id(request, raw)
        self.check_model(request.model)
        self.refuse_speech_to_text("/v1/chat/completions")
        check_stop_and_bad_words(request, self.config.max_stop_sequences, self.config.max_bad_words)
        beam = request.beam_search_params(self._max_tokens(request.max_completion_tokens or request.max_tokens))
        params = request.to_sampling_params(self.engine.generation_defaults.sampling)
        mode = request.tool_choice_mode
        if mode == "auto" and not self.config.enable_auto_tool_choice:
            raise InvalidRequestError("tool_choice", "tool_choice 'auto' (the default with tools) is off on this "
                                      "server (--no-enable-auto-tool-choice); use 'none', 'required' or a named "
                                      "function")

        self.check_request_chat_template(request.chat_template)
        message_dicts, images = request.message_dicts(), []
        if any(message.has_images for message in request.messages):
            message_dicts, images = await _until_disconnect(
                raw, asyncio.to_thread(chat_images, message_dicts, self.media, self.media_limits))
        chat = chat_input(request.messages, message_dicts, request.tool_dicts() or None, mode,
                          request.named_tool, add_generation_prompt=request.add_generation_prompt is not False,
                          chat_template=request.chat_template,
                          continue_final_message=bool(request.continue_final_message),
                          template_kwargs=request.template_kwargs(), content_parts=self.media is not None,
                          # With a reasoning parser, a forced tool call skips the thinking a template opens, and
                          # so does a structured answer where the tags are not single tokens to wait on.
                          close_thinking=self.config.reasoning_parser is not None and (
                              mode in ("required", "named")
                              or (params.structured_outputs is not None and self._thinking_tag_ids is None)))
        truncate = request.truncate_prompt_tokens
        room = _chat_output_room(request, beam is not None)
        self._check_output_room(room)
        self._check_sequences(1, params.n, "messages")  # before any templating
        structured_param = request.structured_outputs_field
        grammar_source = self._grammar_source(params, structured_param)  # its limits, too
        if mode in ("required", "named") and self.grammars is not None:
            self.grammars.check_tools(request.tool_dicts(), mode, request.named_tool)
        original_tokens = None
        if params.prompt_compression is not None:
            chat, original_tokens = await _until_disconnect(raw, self._compress_chat(
                chat, request.messages, params.prompt_compression))
            params = params.replace(prompt_compression=None)
        prompt, count, ids = await _until_disconnect(
            raw, self.text.render_chat(chat, None if truncate else self._prompt_bound))
        token_ids = self._fit_prompt(count, ids, truncate, "messages", room)
        media: tuple[MediaItem, ...] = ()
        if self.media is not None:
            token_ids, media = await _until_disconnect(
                raw, asyncio.to_thread(self.media.expand, token_ids, images, "messages"))
        if beam is not None and media:
            raise InvalidRequestError("use_beam_search", "beam search does not take images")
        if beam is not None and self.streaming is not None:
            # Each beam step's prompt (the prompt and the beam so far) must fit sinks + window.
            room_left = max(self.streaming.num_kept_tokens - len(token_ids), 1)
            beam = dataclasses.replace(beam, max_tokens=min(beam.max_tokens, room_left))
        if beam is not None:
            reasoning = self._reasoning_setup(request, params, prompt.answer_text)
            return await _until_disconnect(raw, self._beam_chat(request, beam, token_ids, reasoning))
        if self.streaming is not None and params.max_tokens is None:
            # The engine does not stop a streamed sequence at the context, so a request that names no limit
            # stops where the context would have ended; past it, max_tokens must say how far.
            params = params.replace(max_tokens=max(self.engine.max_model_len - len(token_ids), 1))
        # A forced call is grammar-constrained wherever the engine has a grammar backend (every engine built by
        # build_engine); without one (a test double), the call's opening in the prompt and the parser remain.
        if mode in ("required", "named") and prompt.assistant_prefix and self.grammars is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError(structured_param, f"tool_choice {request.tool_choice!r} constrains the "
                                          f"answer to a tool call; {structured_param} cannot constrain it too")
            source = self.grammars.tool_call_source(request.tool_dicts(), mode, request.named_tool,
                                                    prompt.tool_format)
            grammar_source = (source, "tools")
            structured_param = "tools"
        grammar = await self._compile_grammar(grammar_source, raw)
        if structured_param == "tools" and grammar is not None:
            # Marks the sequence as constrained; the engine never compiles this spec: it takes the compiled call
            # grammar, or (an engine core in its own process) compiles the call's source sent beside it.
            text = grammar.text if isinstance(grammar, GrammarSource) else str(grammar.grammar)
            params = params.replace(structured_outputs=StructuredOutputsParams(grammar=text))
        if structured_param != "tools":
            params = self._after_thinking(params, prompt.answer_text)
        reasoning = self._reasoning_setup(request, params, prompt.answer_text)  # before the engine takes it
        params = params.replace(output_kind="delta")  # as for completions: streamed, or joined by _collect
        job = await self._submit(f"chatcmpl-{_request_id(request)}", [_Prompt(None, token_ids)], params, arrival,
                                 prompt_param="messages", logprobs_param="top_logprobs", priority=request.priority,
                                 structured_param=structured_param, shape=_chat_shape(request, params),
                                 grammar=grammar, media=media, cache_salt=request.cache_salt)
        job.model_name = self.response_model_name(request.model)
        job.original_prompt_tokens = original_tokens
        tools = _tool_setup(request, prompt.assistant_prefix, prompt.tool_format)  # --tool-call-parser's, if given
        if request.stream:
            return EventStreamResponse(self._chat_stream(request, job, tools, reasoning), on_close=job.abort)
        (final,) = await _until_disconnect(raw, self._collect(job))
        echoed = _chat_echo(request)
        fmt = self._formatter(params.logprobs, request.return_tokens_as_token_ids)
        ids = bool(request.return_token_ids)
        choices = [self._chat_choice(c, params, tools, fmt, echoed, ids, reasoning) for c in final.outputs]
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            prompt_logprobs = fmt.prompt_logprobs(final.prompt_logprobs, request.prompt_logprobs)
        usage = _usage(job, [final])
        if reasoning is not None:
            usage.completion_tokens_details = self._reasoning_tokens(reasoning, [c.token_ids for c in final.outputs])
        response = ChatCompletionResponse(id=job.request_id, created=job.created, model=job.model_name,
                                          choices=choices, usage=usage, prompt_logprobs=prompt_logprobs,
                                          prompt_token_ids=list(final.prompt_token_ids) if ids else None)
        return _within_budget(job, JSONResponse(response.model_dump()))

    async def _beam_chat(self, request: ChatCompletionRequest, beam: BeamSearchParams, token_ids: list[int],
                         reasoning: _ReasoningSetup | None) -> Response:
        (result,) = await search_async(self.engine, [token_ids], beam, request.priority or 0)
        echoed = _chat_echo(request)
        choices = []
        for j, seq in enumerate(result.sequences):
            _, thinking, message = _answer_message(seq.text, echoed, reasoning)
            if thinking is not None:
                message.reasoning = message.reasoning_content = thinking
            choices.append(ChatChoice(index=j, message=message, finish_reason=seq.finish_reason))
        usage = _usage_info(len(token_ids), sum(len(seq.output_token_ids) for seq in result.sequences))
        if reasoning is not None:
            usage.completion_tokens_details = self._reasoning_tokens(
                reasoning, [seq.output_token_ids for seq in result.sequences])
        return JSONResponse(ChatCompletionResponse(id=f"chatcmpl-{_request_id(request)}", choices=choices, usage=usage,
                                                   model=self.response_model_name(request.model)).model_dump())

    @functools.cached_property
    def _thinking_tag_ids(self) -> tuple[int, int] | None:
        """The token ids of THINK_START and THINK_END where each is one token of the tokenizer (a reasoning model's
        are), else None."""
        ids = [self.tokenizer.encode(tag, add_special_tokens=False) for tag in (THINK_START, THINK_END)]
        return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) and ids[0] != ids[1] else None

    def _after_thinking(self, params: SamplingParams, prompt_text: str) -> SamplingParams:
        """A structured answer of a reasoning model thinks first (as the model would unconstrained); its grammar
        applies after the thinking, which the engine waits on by its tags' token ids. `prompt_text`: the answer's
        part of the prompt (ChatPrompt.answer_text)."""
        spec, tags = params.structured_outputs, self._thinking_tag_ids
        if spec is None or self.config.reasoning_parser is None or tags is None:
            return params
        start = thinking_at_start(self.config.reasoning_parser, prompt_text)
        if start is None:  # the prompt closed the thinking: the answer starts with the grammar
            return params
        after = ThinkingTags(tags[0], tags[1], open=start)
        return params.replace(structured_outputs=dataclasses.replace(spec, after_thinking=after))

    def _reasoning_setup(self, request: ChatCompletionRequest, params: SamplingParams,
                         prompt_text: str) -> _ReasoningSetup | None:
        """How this answer's thinking is told apart (None: all of it is content). A grammar from the first token
        (a forced tool call, a structured answer that cannot think first) shapes the whole answer, so its answers
        are not split."""
        parser = self.config.reasoning_parser
        if parser is None:  # no thinking told apart: none to leave out either (include_reasoning asks nothing)
            return None
        if params.structured_outputs is not None and params.structured_outputs.after_thinking is None:
            return None
        return _ReasoningSetup(parser, thinking_at_start(parser, prompt_text), request.include_reasoning is not False)

    def _reasoning_tokens(self, reasoning: _ReasoningSetup, answers: list[list[int]]) -> CompletionTokensDetails:
        token_text = self.engine.core.token_text
        return CompletionTokensDetails(reasoning_tokens=sum(
            count_reasoning_tokens(reasoning.parser, reasoning.start, (token_text(t) or "" for t in ids))
            for ids in answers))

    def _chat_choice(self, c: CompletionOutput, params: SamplingParams, tools: _ToolSetup, fmt: LogprobFormatter,
                     echoed: str = "", ids: bool = False, reasoning: _ReasoningSetup | None = None) -> ChatChoice:
        text, thinking, message = _answer_message(c.text, echoed, reasoning)
        finish_reason = c.finish_reason
        if tools.active:
            parsed = parse_tool_calls(text, tools.names, tools.prefix, tools.format)
            calls = parsed.calls[: None if tools.parallel else 1]
            message = ChatResponseMessage(content=echoed + (parsed.content or "") or None, tool_calls=[
                ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in calls])
            if calls:
                finish_reason = "tool_calls"
            elif tools.named is not None and finish_reason == "length" and tools.prefix:
                # vLLM's answer to a named call cut off by max_tokens: the call, its arguments as far as they
                # got (the server wrote the call's opening, so all the model wrote is arguments), finish "length".
                message = ChatResponseMessage(content=echoed or None, tool_calls=[ToolCall(
                    id=new_tool_call_id(), function=FunctionCall(name=tools.named, arguments=text))])
            elif finish_reason == "length":
                # Calls cut off by max_tokens, as far as they got, as the stream of this answer sends them.
                cut = parse_tool_calls(text, tools.names, tools.prefix, tools.format, cut=True)
                if cut.calls:
                    message = ChatResponseMessage(content=echoed + (cut.content or "") or None, tool_calls=[
                        ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                        for call in cut.calls[: None if tools.parallel else 1]])
        if thinking is not None:
            message.reasoning = message.reasoning_content = thinking
        logprobs = None
        if params.logprobs is not None:
            logprobs = ChatChoiceLogProbs(content=fmt.chat(c.token_ids, c.logprobs))
        return ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                          stop_reason=c.stop_reason, token_ids=list(c.token_ids) if ids else None)

    async def _chat_stream(self, request: ChatCompletionRequest, job: _Submitted, tools: _ToolSetup,
                           reasoning: _ReasoningSetup | None = None) -> AsyncIterator[str]:
        params = job.params
        parsers = ({i: make_tool_parser(tools.format, tools.names, tools.prefix) for i in range(params.n)}
                   if tools.active else {})
        splitters = {i: reasoning.splitter() for i in range(params.n)} if reasoning is not None else {}
        answers: dict[int, list[int]] = {i: [] for i in splitters}  # for the usage's reasoning tokens
        finished: set[int] = set()
        streamed: dict[int, int] = {}  # per choice: the tokens its chunks carried so far
        fmt = self._formatter(params.logprobs, request.return_tokens_as_token_ids)
        ids = bool(request.return_token_ids)

        def render(choices: list[ChatStreamChoice], prompt_token_ids: list[int] | None = None) -> str:
            # with continuous usage, the chunk's own choice so far, as vLLM counts it
            usage = (_usage_of(job, streamed.get(choices[0].index, 0), prompt_index=0) if request.usage_in_every_chunk
                     else None)
            return sse(ChatCompletionChunk(id=job.request_id, created=job.created, model=job.model_name,
                                           choices=choices, prompt_token_ids=prompt_token_ids, usage=usage
                                           ).model_dump_json(exclude_none=True))

        def chunk(choice: ChatStreamChoice, prompt_token_ids: list[int] | None = None) -> str:
            return _charged(job, render([choice], prompt_token_ids))

        if job.budget is not None:
            job.budget.framing = len(render([ChatStreamChoice(index=0, delta=DeltaMessage())]).encode())

        merged = self._merged(job)  # closed here, not by the interpreter's finalizer, whichever way this ends
        try:
            echoed = _chat_echo(request)
            for i in range(params.n):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=echoed)),
                            list(job.prompts[0].token_ids) if ids else None)
            async for _, output in merged:
                for c in output.outputs:
                    if c.index in finished or not (c.delta_text or c.delta_token_ids or c.finished):
                        continue
                    streamed[c.index] = streamed.get(c.index, 0) + len(c.delta_token_ids)
                    text, thinking = c.delta_text, None
                    if reasoning is not None:
                        answers[c.index] += c.delta_token_ids
                        thinking, text = splitters[c.index].feed(c.delta_text, final=c.finished)
                        thinking = (thinking or None) if reasoning.include else None
                    delta, finish_reason = self._chat_delta(c, text, parsers.get(c.index), tools)
                    if thinking is not None:
                        delta.reasoning = delta.reasoning_content = thinking
                    logprobs = None
                    if params.logprobs is not None and c.delta_token_ids:
                        logprobs = ChatChoiceLogProbs(
                            content=fmt.chat(c.delta_token_ids, c.delta_logprobs))
                    if c.finished:
                        finished.add(c.index)
                    if (delta.content or delta.reasoning or delta.tool_calls or logprobs or finish_reason
                            or (ids and c.delta_token_ids)):
                        yield chunk(ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                                     finish_reason=finish_reason,
                                                     stop_reason=c.stop_reason if finish_reason else None,
                                                     token_ids=list(c.delta_token_ids) if ids else None))
            if request.include_usage_in_stream:
                usage = _usage_of(job, sum(streamed.values()))
                if reasoning is not None:
                    usage.completion_tokens_details = self._reasoning_tokens(reasoning, list(answers.values()))
                yield sse(ChatCompletionChunk(id=job.request_id, created=job.created, model=job.model_name,
                                              choices=[], usage=usage).model_dump_json(exclude_none=True))
        except Exception as error:  # the status line is sent: errors can only travel as an event
            await job.abort()
            yield _stream_error(error)
        finally:
            await merged.aclose()
        yield SSE_DONE

    def _chat_delta(self, c: CompletionOutput, text: str, parser: ToolCallParser | MarkedToolCallParser | None,
                    tools: _ToolSetup) -> tuple[DeltaMessage, str | None]:
        """The chunk of `c`'s step, whose answer text (its reasoning split off) is `text`."""
        finish_reason = c.finish_reason if c.finished else None
        if parser is None:
            return DeltaMessage(content=text or None), finish_reason
        events = parser.feed(text)
        if c.finished:
            events += parser.finish(cut=c.finish_reason == "length")
            calls = parser.calls[: None if tools.parallel else 1]
            if calls and all(call.valid for call in calls):
                finish_reason = "tool_calls"
        content, tool_calls = _delta_from_events(events, tools.parallel)
        return DeltaMessage(content=content, tool_calls=tool_calls), finish_reason

    # ----- shared --------------------------------------------------------------------------------

    # ----- prompt compression (docs/long-context.md) ----------------------------------------------------

    def _require_compressor(self) -> PromptCompressor:
        if self.compressor is None:
            raise InvalidRequestError(COMPRESSION_PARAM, "this server has no prompt compressor; start it with "
                                      "--prompt-compressor MODEL_DIR ('kestrel-tiny' for the bundled model) to use "
                                      "prompt_compression")
        return self.compressor

    async def _compress_prompts(self, prompts: Sequence[str | list[int]], options: PromptCompression,
                                add_special_tokens: bool) -> tuple[list[str], int]:
        """Each text prompt compressed (in the compressor's thread), and the original prompts' token count."""
        compressor = self._require_compressor()
        if any(not isinstance(p, str) for p in prompts):
            raise InvalidRequestError(COMPRESSION_PARAM, "prompt_compression compresses text; send the prompt as "
                                      "text, not token ids")
        if options.keep_spans and len(prompts) > 1:
            raise InvalidRequestError(f"{COMPRESSION_PARAM}.keep_spans", "keep_spans index one prompt's "
                                      "characters; send one prompt per request, or mark the spans with the keep "
                                      "markers")
        texts = [p for p in prompts if isinstance(p, str)]
        compressed = [await compressor.compress_text_async(t, options, self.special_texts) for t in texts]
        counts = await self.text.encode_prompts(texts, 0, add_special_tokens, "prompt")
        outs = [c.text or "" for c in compressed]
        kept = await self.text.encode_prompts(outs, 0, add_special_tokens, "prompt")
        original = sum(count for count, _ in counts)
        self.metrics.observe_compression(original - sum(count for count, _ in kept),
                                         sum(c.seconds for c in compressed))
        return outs, original

    async def _compress_chat(self, chat: ChatInput, messages: Sequence[ChatMessage],
                             options: PromptCompression) -> tuple[ChatInput, int]:
        """The chat with its messages compressed (in the compressor's thread), and the original's token count."""
        compressor = self._require_compressor()
        compressed = await compressor.compress_messages_async(chat.messages, options)
        new_messages = compressed.messages or chat.messages
        texts = [text for m, new in zip(messages, new_messages)
                 for text in (m.role, new["content"] if isinstance(new.get("content"), str) else m.text())]
        shorter = dataclasses.replace(chat, messages=new_messages, message_texts=texts)
        _, original, _ = await self.text.render_chat(chat, 0)
        _, kept, _ = await self.text.render_chat(shorter, 0)
        self.metrics.observe_compression(original - kept, compressed.seconds)
        return shorter, original

    def _formatter(self, num_top: int | None, tokens_as_ids: bool | None) -> LogprobFormatter:
        # One token's text, decoded alone and cached by the engine (its logprobs' decoded_token too); its bytes
        # from the tokenizer's shared lookups.
        tokenizer = self.engine.tokenizer
        return LogprobFormatter(self.engine.core.token_text, num_top, bool(tokens_as_ids),
                                TokenizerLookups.of(tokenizer).token_bytes if tokenizer is not None else None)

    async def _encode_prompts(self, prompts: Sequence[str | list[int]], add_special_tokens: bool = True,
                              truncate: int | None = None, param: str = "prompt",
                              room: _OutputRoom | None = None, pooling: bool = False) -> list[_Prompt]:
        """Text prompts are tokenized off the event loop (TextWorkers); one that cannot fit is refused by count.
        `truncate`: keep each prompt's last `truncate` tokens (vLLM's truncate_prompt_tokens); `param`: the
        request field of the prompts, for errors; `room`: the output each prompt must leave room for; `pooling`:
        the prompts are pooled, not continued (one may fill the context)."""
        limit = self.prompt_limit(pooling)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.text.encode_prompts(texts, None if truncate else limit, add_special_tokens,
                                                      param))
        out = []
        for prompt in prompts:
            count, ids = next(encoded) if isinstance(prompt, str) else (len(prompt), list(prompt))
            # A truncated prompt's text is no longer the prompt: echo and detokenization use the ids.
            out.append(_Prompt(prompt if isinstance(prompt, str) and not truncate else None,
                               self._fit_prompt(count, ids, truncate, param, room, pooling)))
        return out

    def check_request_chat_template(self, template: str | None) -> None:
        """A chat template sent with a request is taken only where the server trusts request templates."""
        if template is not None and not self.config.trust_request_chat_template:
            raise InvalidRequestError("chat_template", "this server does not take chat templates from requests; "
                                      "start it with --trust-request-chat-template, or give the server one with "
                                      "--chat-template")

    def _max_tokens(self, asked: int | None) -> int:
        """A beam search's length: what the request asked (None: the context), under the model's
        generation_config max_new_tokens."""
        limit = self.engine.generation_defaults.sampling.get("max_tokens")
        return capped_max_tokens(asked or self.engine.max_model_len, limit)  # type: ignore[return-value]

    def _fit_prompt(self, count: int, ids: list[int] | None, truncate: int | None, param: str,
                    room: _OutputRoom | None = None, pooling: bool = False) -> list[int]:
        """The prompt's ids, its last `truncate` when asked; a prompt the context cannot hold is refused (`ids`
        None: the tokenizer reported only its `count`), and so is one that leaves no room for `room`'s tokens."""
        limit = self.engine.max_model_len
        truncate = truncation_size(truncate, limit)
        if ids is not None and truncate:
            ids = ids[-truncate:]
        if ids is None or len(ids) >= self.prompt_limit(pooling):
            raise self._prompt_too_long(count if ids is None else len(ids), param, pooling)
        if self.streaming is not None:
            kept = self.streaming.num_kept_tokens
            if room is not None and room.beam and len(ids) + room.tokens > kept:
                raise InvalidRequestError(room.param, f"the prompt has {len(ids)} tokens and {room.param}="
                                          f"{room.tokens} output tokens were requested, {len(ids) + room.tokens} in "
                                          f"all, but a beam search does not slide the streaming window: it runs "
                                          f"within --streaming-window sink_tokens + window = {kept} tokens; shorten "
                                          f"the prompt or lower {room.param}")
            return ids
        if room is not None and len(ids) + room.tokens > limit:
            raise InvalidRequestError(room.param, f"the prompt has {len(ids)} tokens and {room.param}="
                                      f"{room.tokens} output tokens were requested, {len(ids) + room.tokens} in "
                                      f"all, but the model's context is max_model_len={limit} tokens, which "
                                      f"leaves room for a prompt of at most {limit - room.tokens} tokens; shorten "
                                      f"the prompt or lower {room.param}")
        return ids

    @property
    def _prompt_bound(self) -> int:
        """Prompts of this many tokens or more are refused: the context less one generated token, or with a
        streaming window one more than sinks + window (the engine streams on past the context)."""
        if self.streaming is not None:
            return self.streaming.num_kept_tokens + 1
        return self.engine.max_model_len

    def prompt_limit(self, pooling: bool = False) -> int:
        """Prompts of this many tokens or more are refused: `_prompt_bound`, or for a pooled prompt (no token
        generated) one more, without a streaming window."""
        return self._prompt_bound + (pooling and self.streaming is None)

    def _prompt_too_long(self, num_tokens: int, param: str, pooling: bool = False) -> InvalidRequestError:
        if self.streaming is None:
            return prompt_too_long(num_tokens, self.engine.max_model_len, param, generates=not pooling)
        kept = self.streaming.num_kept_tokens
        return InvalidRequestError(param, f"the prompt has {num_tokens} tokens but this server streams with "
                                   f"--streaming-window sink_tokens={self.streaming.sink_tokens} + window="
                                   f"{self.streaming.window} = {kept} tokens attended, which the prompt must fit; "
                                   f"shorten the prompt to at most {kept} tokens")

    def _check_output_room(self, room: _OutputRoom) -> None:
        """An output longer than the whole context (with a streaming window: than --max-streaming-tokens, or for a
        beam search than sinks + window) is refused before any tokenizing."""
        if self.streaming is not None:
            cap, flag = ((self.streaming.num_kept_tokens, "--streaming-window sink_tokens + window") if room.beam
                         else (self.config.max_streaming_tokens, "--max-streaming-tokens"))
            if room.tokens > cap:
                raise InvalidRequestError(room.param, f"{room.param}={room.tokens} is more than this server's limit "
                                          f"of {cap:,} output tokens a request ({flag}); request fewer output "
                                          "tokens")
            return
        limit = self.engine.max_model_len
        if room.tokens > limit:
            raise InvalidRequestError(room.param, f"{room.param}={room.tokens} cannot be greater than "
                                      f"max_model_len={limit}; request fewer output tokens")

    def _prompt_text(self, prompt: _Prompt, params: SamplingParams) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=params.skip_special_tokens)

    def _check_sequences(self, num_prompts: int, n: int, prompt_param: str) -> None:
        limit = self.engine.max_sequences_per_request
        if limit is not None and num_prompts * n > limit:
            raise InvalidRequestError("n" if n > 1 else prompt_param,
                                      f"{num_prompts} prompt(s) x n={n} is more sequences than this server ever "
                                      f"admits at once ({limit}); split the request")

    def _check_logprob_entries(self, prompts: list[_Prompt], params: SamplingParams, param: str) -> None:
        """Bound the response: n x (echoed prompt + generated tokens) x (logprobs + 1) entries, before any work."""
        k = max(params.logprobs if params.logprobs is not None else -1,
                params.prompt_logprobs if params.prompt_logprobs is not None else -1)
        if k < 0:
            return
        context = self.engine.max_model_len
        entries = 0
        for prompt in prompts:
            generated = params.max_tokens if params.max_tokens is not None else context - len(prompt.token_ids)
            echoed = len(prompt.token_ids) if params.prompt_logprobs is not None else 0
            entries += params.n * (echoed + max(generated, 0)) * (k + 1)
        if entries > self.max_logprob_entries:
            raise InvalidRequestError(param, f"the response would carry {entries:,} logprob entries (n x tokens x "
                                      f"(logprobs + 1)), more than this server's limit of "
                                      f"{self.max_logprob_entries:,}; lower n, max_tokens or {param}, or start the "
                                      "server with a larger --max-logprob-entries")

    def _response_budget(self, prompts: list[_Prompt], params: SamplingParams,
                         shape: ResponseShape | None) -> ResponseBudget | None:
        """Refuse a response whose estimated size passes --max-response-bytes; the budget that counts the rest."""
        if shape is None:
            return None
        limit = self.config.max_response_bytes
        check_estimate(shape, estimate(shape, [len(p.token_ids) for p in prompts], params.max_tokens,
                                       self.engine.max_model_len), limit, len(prompts))
        return ResponseBudget(limit, shape)

    async def _submit(self, request_id: str, prompts: list[_Prompt], params: SamplingParams,
                      arrival: float, prompt_param: str, logprobs_param: str, priority: int | None = None,
                      structured_param: str = "structured_outputs", shape: ResponseShape | None = None,
                      grammar: Any = None, media: tuple[MediaItem, ...] = (),
                      cache_salt: str | None = None) -> _Submitted:
        """Check the response's size, queue one engine request per prompt (all or none) and wait until the engine
        accepted them (the routes checked the number of sequences before their tokenizing). Refusals name the
        request's own fields (`prompt_param`, `logprobs_param`), not the engine's. `grammar`: the compiled grammar
        of params.structured_outputs (_compile_grammar), which the engine then does not compile."""
        self._check_logprob_entries(prompts, params, logprobs_param)
        budget = self._response_budget(prompts, params, shape)
        trackers = [self.metrics.tracker(arrival, params) for _ in prompts]
        self.engine.check_capacity(len(prompts) * params.n)
        # The engine's ids: the response's, made unique, since clients (and proxies stamping X-Request-Id) may send
        # one id with several requests at once, or again while the last one's abort is still under way.
        engine_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        ids = [engine_id] if len(prompts) == 1 else [f"{engine_id}-{i}" for i in range(len(prompts))]
        with_media = {"media": media} if media else {}  # only a multimodal engine (in-process) takes media
        rest = {"params": params, "priority": priority or 0, "grammar": grammar, "cache_salt": cache_salt,
                **with_media}
        try:
            streams = submit_all(self.engine, [(rid, p.token_ids, {**rest, "prompt": p.text})
                                               for rid, p in zip(ids, prompts)])
        except RequestIdInUseError as error:  # the random part of the engine's id came twice: retry
            raise InvalidRequestError("request_id", f"{error}; send the request again") from None
        try:
            for stream in streams:
                await stream.accepted()
        except BaseException as error:
            for stream in streams:
                await stream.aclose()
            if isinstance(error, InvalidRequestError) and error.param in ("prompt", "prompt_token_ids"):
                raise InvalidRequestError(prompt_param, str(error)) from None
            if isinstance(error, InvalidRequestError) and error.param.startswith("structured_outputs"):
                raise InvalidRequestError(structured_param, str(error)) from None
            if isinstance(error, InvalidRequestError) and error.param == "logprobs":
                raise InvalidRequestError(logprobs_param, str(error).replace("logprobs=", f"{logprobs_param}=", 1)
                                          ) from None
            raise
        if self.config.enable_log_requests:
            logger.info("request %s (engine %s): %d prompt(s), %s prompt tokens, %r", request_id, engine_id,
                        len(prompts), [len(p.token_ids) for p in prompts], params)
        return _Submitted(streams, trackers, prompts, params, request_id, budget=budget,
                          report_cached=self.config.enable_prompt_tokens_details)

    def _grammar_source(self, params: SamplingParams, field: str) -> tuple[GrammarSource, str] | None:
        """The request's grammar and the field it came from (`structured_outputs.json`, `response_format`, ...),
        checked against the server's grammar limits before any other work; None without one."""
        spec = params.structured_outputs
        if spec is None or self.grammars is None:
            return None
        param = f"{field}.{spec.kind}" if field == "structured_outputs" else field
        return self.grammars.source(spec, param), param

    async def _compile_grammar(self, grammar: tuple[GrammarSource, str] | None, raw: Request) -> Any:
        """The compiled grammar (GrammarCompilePool: off the event loop and the engine, under the compile deadline),
        before the request enters the engine; a client that goes away meanwhile stops the compile."""
        if grammar is None or self.grammars is None:
            return None
        source, param = grammar
        return await _until_disconnect(raw, self.grammars.compile(source, param))

    async def _collect(self, job: _Submitted) -> list[RequestOutput]:
        """The final output of every engine request of the job, whole (delta outputs joined as they come)."""
        joiners = [DeltaJoiner() for _ in job.streams]
        finished = [False] * len(job.streams)
        async with contextlib.aclosing(self._merged(job)) as outputs:
            async for i, output in outputs:
                if job.budget is not None:
                    job.budget.output(output)  # ends the work once the body would surely pass the budget
                joiners[i].add(output)
                finished[i] = output.finished
        if not all(finished):
            raise EngineDeadError("a request ended without a final output")
        return [joiner.joined() for joiner in joiners]  # type: ignore[misc]

    async def _merged(self, job: _Submitted) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all of the job's streams as they come; aborts the rest on exit."""
        try:
            if len(job.streams) == 1:
                async for output in job.streams[0]:
                    job.trackers[0].observe(output)
                    job.cached_tokens[0] = output.num_cached_tokens
                    yield 0, output
                return
            async with contextlib.aclosing(_merge(job.streams)) as outputs:
                async for i, output in outputs:
                    job.trackers[i].observe(output)
                    job.cached_tokens[i] = output.num_cached_tokens
                    yield i, output
        finally:
            for stream in job.streams:
                await stream.aclose()
            for tracker in job.trackers:
                tracker.aborted()  # a no-op for the requests that finished


def _without_generation(output: RequestOutput) -> RequestOutput:
    """An echo-only completion (max_tokens 0): the one token the engine sampled to finish the prompt's run is
    dropped; the choice ends at its limit of 0 tokens."""
    def nothing(c: CompletionOutput) -> CompletionOutput:
        empty = [] if c.logprobs is not None else None
        return CompletionOutput(index=c.index, text="", token_ids=[], logprobs=empty,
                                finish_reason="length" if c.finished else None, delta_logprobs=empty)

    return dataclasses.replace(output, outputs=[nothing(c) for c in output.outputs])


def _reported_prompt_logprobs(request: CompletionRequest) -> int | None:
    """The top-N of a completion's choices[].prompt_logprobs: the request's prompt_logprobs, else with echo its
    logprobs (vLLM's rule), else none."""
    if request.prompt_logprobs is not None:
        return request.prompt_logprobs
    return request.logprobs if request.echo else None


def _completion_shape(request: CompletionRequest, params: SamplingParams, prompts: list[_Prompt]) -> ResponseShape:
    echo_bytes = [len(p.text.encode()) if p.text is not None else len(p.token_ids) * TEXT_BYTES_PER_TOKEN
                  for p in prompts] if request.echo else []
    return ResponseShape(chat=False, n=params.n, logprobs=params.logprobs,
                         prompt_logprobs=_reported_prompt_logprobs(request),
                         echo_bytes=echo_bytes, echo_logprobs=bool(request.echo) and params.logprobs is not None,
                         token_ids=bool(request.return_token_ids))


def _chat_shape(request: ChatCompletionRequest, params: SamplingParams) -> ResponseShape:
    return ResponseShape(chat=True, n=params.n, logprobs=params.logprobs, prompt_logprobs=request.prompt_logprobs,
                         echo_bytes=[len(_chat_echo(request).encode())], token_ids=bool(request.return_token_ids),
                         max_tokens_param="max_tokens" if request.max_completion_tokens is None
                         else "max_completion_tokens",
                         logprobs_param="top_logprobs" if request.top_logprobs else "logprobs")


def _charged(job: _Submitted, event: str) -> str:
    """A streamed event, counted against the response's budget."""
    return job.budget.event(event) if job.budget is not None else event


def _within_budget(job: _Submitted, response: JSONResponse) -> JSONResponse:
    """A whole response, refused if its body passes the budget."""
    if job.budget is not None:
        job.budget.body(response.body)
    return response


def _request_id(request: CompletionRequest | ChatCompletionRequest) -> str:
    """The request's id after its response prefix: the client's request_id (vLLM's field, or its X-Request-Id
    header: `_with_header_id`), else a fresh one."""
    return request.request_id or uuid.uuid4().hex


def _with_header_id(request: RequestModel, raw: Request) -> RequestModel:
    """The request with its X-Request-Id header as its request_id, as vLLM names a response by the header before
    the body's field; a header value the body's field would refuse is a 400 naming the header."""
    header = raw.headers.get("x-request-id")
    if header is None:
        return request
    if not 1 <= len(header) <= 256 or not all("\x21" <= ch <= "\x7e" for ch in header):
        raise InvalidRequestError("X-Request-Id", "the X-Request-Id header must be 1 to 256 printable ASCII "
                                  "characters without spaces")
    return request.model_copy(update={"request_id": header})


def _chat_echo(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text leads the answer when it is the assistant's own (the turn the
    model continues); otherwise nothing is echoed."""
    last = request.messages[-1]
    return last.text() if request.echo and last.role == "assistant" else ""


def _answer_message(answer: str, echoed: str, reasoning: _ReasoningSetup | None,
                    ) -> tuple[str, str | None, ChatResponseMessage]:
    """A whole chat answer's content text (its thinking split off, where a reasoning parser reads it), the thinking
    the response carries (None: none, or include_reasoning false) and its message before any tool calls: an answer
    that ended in (or right after) its thinking has null content, as vLLM's parsers give it."""
    text, thinking = answer, None
    if reasoning is not None:
        thinking, text = split_reasoning(reasoning.parser, answer, reasoning.start)
    message = ChatResponseMessage(content=echoed + text if echoed or text or thinking is None else None)
    return text, thinking if reasoning is not None and reasoning.include else None, message


@dataclass(frozen=True)
class _ReasoningSetup:
    """An answer's thinking told apart by `parser`; `start`: where the answer starts (reasoning.thinking_at_start);
    `include`: the response carries the thinking (include_reasoning)."""

    parser: str
    start: bool | None
    include: bool

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.parser, self.start)


@dataclass(frozen=True)
class _ToolSetup:
    active: bool
    names: frozenset[str]
    prefix: str
    parallel: bool
    format: str = "llama3_json"
    named: str | None = None  # the function tool_choice names


def _tool_setup(request: ChatCompletionRequest, prefix: str, fmt: str = "llama3_json") -> _ToolSetup:
    mode = request.tool_choice_mode
    names = [request.named_tool or ""] if mode == "named" else [t.function.name for t in request.tools or []]
    return _ToolSetup(active=mode != "none", names=frozenset(names), prefix=prefix,
                      parallel=request.parallel_tool_calls is not False, format=fmt,
                      named=request.named_tool if mode == "named" else None)


def _delta_from_events(events: list[ParserEvent], parallel: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta)) or None
    calls: list[DeltaToolCall] = []
    for event in events:
        if isinstance(event, ContentDelta) or (not parallel and event.index > 0):
            continue
        if isinstance(event, ToolCallStart):
            calls.append(DeltaToolCall(index=event.index, id=event.id, type="function",
                                       function=DeltaFunctionCall(name=event.name, arguments="")))
        elif isinstance(event, ToolArgumentsDelta):
            last = calls[-1] if calls else None
            if last is not None and last.index == event.index and last.function is not None:
                last.function.arguments = (last.function.arguments or "") + event.text
            else:
                calls.append(DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text)))
    return content, calls or None


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as error:
            queue.put_nowait((i, error))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _until_disconnect(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnectedError("the client disconnected")


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _usage(job: _Submitted, finals: list[RequestOutput]) -> UsageInfo:
    return _usage_of(job, sum(len(c.token_ids) for final in finals for c in final.outputs))


def _usage_of(job: _Submitted, completion_tokens: int, prompt_index: int | None = None) -> UsageInfo:
    """The request's usage; with `prompt_index`, one prompt's (a streamed chunk's under continuous_usage_stats: its
    prompt and its choice so far, where the stream's closing usage chunk counts them all)."""
    indices = range(len(job.prompts)) if prompt_index is None else [prompt_index]
    usage = _usage_info(sum(len(job.prompts[i].token_ids) for i in indices), completion_tokens)
    if prompt_index is None or len(job.prompts) == 1:
        usage.original_prompt_tokens = job.original_prompt_tokens
    if job.report_cached:
        usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=sum(job.cached_tokens.get(i, 0)
                                                                            for i in indices))
    return usage


def _usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _stream_error(error: Exception) -> str:
    if isinstance(error, RequestTimeoutError):
        body = error_body(str(error), "timeout_error", code="request_timeout")
    elif isinstance(error, EngineDeadError):
        body = error_body(str(error), "server_error", code="engine_dead")
    elif isinstance(error, ServerShuttingDownError):
        body = error_body(str(error), "server_error", code="server_shutting_down")
    elif isinstance(error, InvalidRequestError):  # a limit the response passed while it was produced
        body = error_body(str(error), "invalid_request_error", error.param, error.code)
    else:
        logger.exception("unexpected error while streaming a response", exc_info=error)
        body = error_body("internal server error; see the server log", "server_error", code="internal_error")
    return sse(json.dumps(body))


class EventStreamResponse(StreamingResponse):
    """Server-sent events; a client disconnect cancels the stream, and the generator is always closed. `on_close`
    runs after it too: closing a generator that never started runs none of its cleanup (a client gone before the
    first event), so the work behind the stream is ended there."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_disconnected_asgi(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self._events.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:
                await self.on_close()
        error = None if streamer.cancelled() else streamer.exception()
        if error is not None and not isinstance(error, OSError):
            raise error  # a bug, not a client going away: let the server log it


async def _disconnected_asgi(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
