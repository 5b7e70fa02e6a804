"""/v1/audio/transcriptions and /v1/audio/translations (OpenAI's multipart form) for an encoder-decoder speech model
(Whisper).

The uploaded file is decoded with libsndfile, mixed to mono and resampled to the feature extractor's rate, and cut
into windows of at most the extractor's length (30 s for the published checkpoints), each cut at the quietest 20 ms
near the window's end (`window_bounds`). Each window is one engine request whose decoder prompt is Whisper's forced
tokens from the checkpoint's generation_config.json (`<|startofprev|>` and the `prompt` text first when given,
`<|startoftranscript|>`, the language (given, or detected by one greedy step over the language tokens),
`<|transcribe|>` or `<|translate|>`, and `<|notimestamps|>` unless segment timestamps are asked for). The windows'
texts are joined in order; segment times are the timestamp tokens the model wrote, offset by their window's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from kestrel.entrypoints.async_engine import submit_all
from kestrel.entrypoints.media import Audio, decode_audio, resample
from kestrel.entrypoints.serving import (
    SSE_DONE,
    EventStreamResponse,
    OpenAIServing,
    _stream_error,
    _until_disconnect,
    sse,
)
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SamplingParams

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TIMESTAMPED_FORMATS = ("verbose_json", "srt", "vtt")
GRANULARITIES = ("segment",)  # word timestamps are not supported
TIMESTAMP_SECONDS = 0.02  # Whisper's timestamp tokens count in steps of 20 ms
WHISPER_TASKS = {"transcription": "transcribe", "translation": "translate"}  # endpoint -> task_to_id key
COMMON_FIELDS = ("file", "model", "prompt", "response_format", "temperature", "language")
FIELDS = {"transcription": (*COMMON_FIELDS, "timestamp_granularities[]", "stream"),
          "translation": COMMON_FIELDS}


def openapi_form(task: str) -> dict[str, Any]:
    """The endpoint's multipart form as the OpenAPI document describes it (the handler reads the form itself, so
    that every unknown or malformed field is refused by name)."""
    properties: dict[str, Any] = {
        "file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
        "language": {"type": "string"}, "prompt": {"type": "string"},
        "response_format": {"type": "string", "enum": list(RESPONSE_FORMATS)},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1}}
    if task == "transcription":
        properties["timestamp_granularities[]"] = {"type": "array", "items": {"type": "string",
                                                                              "enum": ["segment", "word"]}}
        properties["stream"] = {"type": "boolean"}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "model"], "properties": properties,
        "additionalProperties": False}}}}}


RESPONSE_CONTENT = {"application/json": {"schema": {"type": "object"}}, "text/plain": {"schema": {"type": "string"}},
                    "text/event-stream": {"schema": {"type": "string"}}}


@dataclass(frozen=True)
class AudioRequest:
    """The form's fields, checked."""

    audio: Audio
    model: str | None
    language: str | None  # None: detected from the first window
    prompt: str | None
    response_format: str
    temperature: float
    segments: bool  # segment timestamps: asked for, or needed by the response format
    stream: bool


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    text: str
    token_ids: list[int]
    logprobs: list[float]  # each token's log probability (verbose_json's avg_logprob); empty when not asked for


class OpenAIServingAudio:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine
        self.tokenizer = serving.tokenizer
        media = serving.media
        self.media = media if media is not None and getattr(media, "encoder_decoder", False) else None
        self.generation: dict[str, Any] = {}
        if self.media is not None:
            self.generation = _generation_config(self.engine.core.config.model.generation_config_path)
        # Whisper's timestamp tokens follow <|notimestamps|> (`<|0.00|>` first), as transformers counts them.
        no_timestamps = self.generation.get("no_timestamps_token_id")
        self._timestamp_begin = None if no_timestamps is None else int(no_timestamps) + 1
        self._no_speech_token = _special_token_id(self.tokenizer, NO_SPEECH_TOKENS)
        # generation_config's suppress_tokens never come out (each a one-token bad word); begin_suppress_tokens'
        # end-of-text is held back from the first position (min_tokens 1), its other tokens are not applied
        self._suppressed = [[int(t)] for t in self.generation.get("suppress_tokens") or []]
        end = self.generation.get("eos_token_id")
        self._end_suppressed_first = end is not None and end in (self.generation.get("begin_suppress_tokens") or [])

    async def create(self, task: str, raw: Request) -> Response:
        endpoint = f"/v1/audio/{task}s"
        arrival = time.monotonic()
        try:
            form = await raw.form()
        except HTTPException as e:  # a body that is no multipart (or urlencoded) form
            raise InvalidRequestError("form", f"{endpoint} takes a multipart form (file, model, ...): "
                                      f"{e.detail}") from None
        if self.media is None:
            raise InvalidRequestError("model", f"{endpoint} needs a speech-to-text (encoder-decoder, Whisper) model; "
                                      f"the served model {self.serving.model_name!r} is not one")
        request = await asyncio.to_thread(self._parse, task, form)
        self.serving.check_model(request.model)
        samples = resample(request.audio.samples, request.audio.rate, self.media.sampling_rate)
        bounds = window_bounds(samples, self.media.max_audio_samples, self.media.sampling_rate)
        chunks = [samples[start:end] for start, end in bounds]
        request_id = f"trsc-{uuid.uuid4().hex}"
        if request.language is None:
            language = await _until_disconnect(raw, self._detect_language(f"{request_id}-language", chunks[0],
                                                                          arrival))
            request = dataclasses.replace(request, language=language)
        prompt_ids = self._decoder_prompt(task, request)
        max_tokens = self.engine.max_model_len - len(prompt_ids)
        if max_tokens < 1:
            raise InvalidRequestError("prompt", f"the prompt takes {len(prompt_ids)} of the decoder's "
                                      f"{self.engine.max_model_len} positions; shorten it")
        verbose = request.response_format == "verbose_json"
        params = SamplingParams(temperature=request.temperature, max_tokens=max_tokens,
                                skip_special_tokens=True, logprobs=0 if verbose else None,
                                bad_words_token_ids=self._suppressed or None,
                                min_tokens=1 if self._end_suppressed_first else 0)
        items = [await asyncio.to_thread(self.media.expand, prompt_ids, [Audio(chunk, self.media.sampling_rate)],
                                         "file") for chunk in chunks]
        duration = samples.shape[0] / self.media.sampling_rate
        if request.stream:
            return EventStreamResponse(self._stream(request_id, items, params, arrival, duration))
        outputs = await _until_disconnect(raw, self._run(request_id, items, params, arrival))
        no_speech = (await _until_disconnect(raw, self._no_speech_probs(f"{request_id}-no-speech", chunks, arrival))
                     if verbose else [])
        rate = self.media.sampling_rate
        return self._response(task, request, outputs, [(start / rate, end / rate) for start, end in bounds],
                              no_speech)

    # ----- the form -------------------------------------------------------------------------------------

    def _parse(self, task: str, form: Any) -> AudioRequest:
        allowed = FIELDS[task]
        for key in form.keys():  # noqa: SIM118 - a multidict
            if not key:
                raise InvalidRequestError("form", "the form has a field without a name")
            if key not in allowed:
                raise InvalidRequestError(key, f"unsupported field {key!r} for /v1/audio/{task}s; it takes "
                                          f"{', '.join(allowed)}")
        for key in allowed:
            if key != "timestamp_granularities[]" and len(form.getlist(key)) > 1:
                raise InvalidRequestError(key, f"{key} was given {len(form.getlist(key))} times; give it once")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequestError("file", "the audio file is missing: send it as the multipart field 'file'")
        data = upload.file.read(self.serving.media_limits.max_bytes + 1)
        if len(data) > self.serving.media_limits.max_bytes:
            raise InvalidRequestError("file", f"the file is larger than this server's "
                                      f"{self.serving.media_limits.max_bytes:,} bytes (--max-media-bytes)")
        audio = decode_audio(data, "file", self.serving.media_limits)
        response_format = _text(form, "response_format") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise InvalidRequestError("response_format", f"unsupported response_format {response_format!r}; use "
                                      f"one of {', '.join(RESPONSE_FORMATS)}")
        granularities = [_as_text(g, "timestamp_granularities[]") for g in form.getlist("timestamp_granularities[]")]
        for granularity in granularities:
            if granularity not in GRANULARITIES:
                raise InvalidRequestError("timestamp_granularities", f"unsupported timestamp granularity "
                                          f"{granularity!r}: kestrel gives segment timestamps only (from Whisper's "
                                          "timestamp tokens), not word timestamps")
        if granularities and response_format != "verbose_json":
            raise InvalidRequestError("timestamp_granularities", "timestamp_granularities needs "
                                      "response_format='verbose_json'")
        stream = _boolean(form, "stream")
        if stream and response_format not in ("json", "text"):
            raise InvalidRequestError("stream", f"stream=true gives the text as it is written; response_format "
                                      f"{response_format!r} is not streamed (use json or text)")
        return AudioRequest(audio=audio, model=_text(form, "model"), language=self._language(_text(form, "language")),
                            prompt=_text(form, "prompt"), response_format=response_format,
                            temperature=_temperature(form), stream=stream,
                            segments=response_format in TIMESTAMPED_FORMATS or bool(granularities))

    def _language(self, language: str | None) -> str | None:
        """The language code given, "" for a model without language tokens, or None: detect it."""
        table: dict[str, int] = self.generation.get("lang_to_id") or {}
        known = sorted(token[2:-2] for token in table)
        if language is None:
            return "" if not table else None
        if f"<|{language}|>" not in table:
            raise InvalidRequestError("language", f"unsupported language {language!r}: this model knows "
                                      f"{', '.join(known) or 'no language tokens'} (ISO-639-1 codes)")
        return language

    def _start_token(self) -> int:
        return int(self.generation.get("decoder_start_token_id")
                   or self.engine.core.config.model.hf_config["decoder_start_token_id"])

    def _decoder_prompt(self, task: str, request: AudioRequest) -> list[int]:
        """Whisper's forced decoder tokens from generation_config.json (the previous-text prompt first)."""
        generation = self.generation
        ids: list[int] = []
        if request.prompt:
            previous = self.tokenizer.convert_tokens_to_ids("<|startofprev|>")
            ids += [previous, *self.tokenizer.encode(" " + request.prompt.strip(), add_special_tokens=False)]
        ids.append(self._start_token())
        if request.language:
            ids.append(int(generation["lang_to_id"][f"<|{request.language}|>"]))
        tasks: dict[str, int] = generation.get("task_to_id") or {}
        if WHISPER_TASKS[task] in tasks:
            ids.append(int(tasks[WHISPER_TASKS[task]]))
        elif task == "translation":
            raise InvalidRequestError("model", "this model's generation_config.json has no translate task; it "
                                      "transcribes only (use /v1/audio/transcriptions)")
        no_timestamps = generation.get("no_timestamps_token_id")
        if not request.segments and no_timestamps is not None:
            ids.append(int(no_timestamps))
        return ids

    # ----- running -------------------------------------------------------------------------------------

    async def _detect_language(self, request_id: str, chunk: Any, arrival: float) -> str:
        """The language Whisper reads in the window: one greedy step after <|startoftranscript|> over the
        checkpoint's language tokens only, as transformers' `detect_language` (the encoder output is cached, so
        the transcription that follows does not encode the window again)."""
        table: dict[str, int] = self.generation["lang_to_id"]
        by_id = {int(token_id): token[2:-2] for token, token_id in table.items()}
        prompt = [self._start_token()]
        item = await asyncio.to_thread(self.media.expand, prompt, [Audio(chunk, self.media.sampling_rate)], "file")
        params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=sorted(by_id))
        outputs = await self._run(request_id, [item], params, arrival)
        return by_id[outputs[0].outputs[0].token_ids[0]]

    async def _run(self, request_id: str, items: list[Any], params: SamplingParams, arrival: float) -> list[Any]:
        """Each window's final output, in order (all windows queued at once)."""
        outputs = []
        async with contextlib.aclosing(self._outputs(request_id, items, params, arrival)) as stream:
            async for index, output in stream:
                if output.finished:
                    outputs.append((index, output))
        return [output for _, output in sorted(outputs, key=lambda pair: pair[0])]

    async def _outputs(self, request_id: str, items: list[Any], params: SamplingParams,
                       arrival: float) -> AsyncIterator[tuple[int, Any]]:
        """The windows' outputs, one window after the other (a stream's deltas come out in order)."""
        engine = self.engine
        engine.check_capacity(len(items))
        streams = submit_all(engine, [(f"{request_id}-{i}", ids, {"params": params, "media": media})
                                      for i, (ids, media) in enumerate(items)])
        trackers = [self.serving.metrics.tracker(arrival) for _ in streams]
        try:
            for i, stream in enumerate(streams):
                await stream.accepted()
                async for output in stream:
                    trackers[i].observe(output)
                    yield i, output
        finally:
            for stream, tracker in zip(streams, trackers):
                await stream.aclose()
                tracker.aborted()

    async def _stream(self, request_id: str, items: list[Any], params: SamplingParams, arrival: float,
                      duration: float) -> AsyncIterator[str]:
        text = ""
        try:
            async with contextlib.aclosing(self._outputs(request_id, items, params, arrival)) as outputs:
                async for _, output in outputs:
                    piece = output.outputs[0].delta_text
                    if piece:
                        text += piece
                        yield _sse({"type": "transcript.text.delta", "delta": piece})
            yield _sse({"type": "transcript.text.done", "text": text, "usage": _usage(duration)})
        except Exception as error:  # the status line is sent: errors can only travel as an event
            yield _stream_error(error)
        yield SSE_DONE

    def _response(self, task: str, request: AudioRequest, outputs: list[Any],
                  spans: list[tuple[float, float]], no_speech: list[float | None]) -> Response:
        """`spans`: each window's (start, end) in seconds of the file; `no_speech`: each window's probability of
        Whisper's no-speech token (verbose_json)."""
        duration = spans[-1][1]
        text = "".join(output.outputs[0].text for output in outputs)
        if request.response_format == "text":
            return PlainTextResponse(text)
        if request.response_format == "json":
            return JSONResponse({"text": text, "usage": _usage(duration)})
        windows = [(window, self._segments(list(output.outputs[0].token_ids), start, end,
                                           _token_logprobs(output.outputs[0])))
                   for window, (output, (start, end)) in enumerate(zip(outputs, spans))]
        segments = [segment for _, window_segments in windows for segment in window_segments]
        if request.response_format == "srt":
            return PlainTextResponse(_srt(segments))
        if request.response_format == "vtt":
            return PlainTextResponse(_vtt(segments))
        rows = [(window, segment) for window, window_segments in windows for segment in window_segments]
        body = {"task": WHISPER_TASKS[task], "language": _language_name(request.language),
                "duration": round(duration, 3), "text": text,
                "segments": [{"id": i, "seek": round(spans[window][0] * 100), "start": seg.start, "end": seg.end,
                              "text": seg.text, "tokens": seg.token_ids, "temperature": request.temperature,
                              "avg_logprob": _mean(seg.logprobs), "compression_ratio": compression_ratio(seg.text),
                              "no_speech_prob": no_speech[window]} for i, (window, seg) in enumerate(rows)],
                "usage": _usage(duration)}
        return JSONResponse(body)

    async def _no_speech_probs(self, request_id: str, chunks: list[Any], arrival: float) -> list[float | None]:
        """Each window's probability of the no-speech token right after <|startoftranscript|> (what Whisper
        reports as no_speech_prob): one step whose sampled token is forced to it, its raw log probability taken
        over the whole vocabulary (the encoder outputs are cached). None for a checkpoint without that token."""
        token = self._no_speech_token
        if token is None:
            return [None] * len(chunks)
        params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=[token], logprobs=0)
        items = [await asyncio.to_thread(self.media.expand, [self._start_token()],
                                         [Audio(chunk, self.media.sampling_rate)], "file") for chunk in chunks]
        outputs = await self._run(request_id, items, params, arrival)
        return [round(math.exp(_token_logprobs(o.outputs[0])[0]), 6) for o in outputs]

    def _segments(self, token_ids: list[int], offset: float, end: float,
                  logprobs: list[float] | None = None) -> list[Segment]:
        """The output's segments: runs of text tokens between timestamp tokens (a run with no timestamp before it
        starts at the window's start, one with none after it ends at the window's end); `logprobs`: each token's,
        kept with its segment's tokens."""
        begin = self._timestamp_begin
        segments: list[Segment] = []
        start, run, run_logprobs = offset, [], []
        for position, token in enumerate(token_ids):
            if begin is not None and token >= begin:
                at = min(offset + (token - begin) * TIMESTAMP_SECONDS, end)
                if run:
                    segments.append(Segment(round(start, 2), round(at, 2), self._decode(run), run, run_logprobs))
                    run, run_logprobs = [], []
                start = at
            else:
                run.append(token)
                if logprobs:
                    run_logprobs.append(logprobs[position])
        if run:
            segments.append(Segment(round(start, 2), round(end, 2), self._decode(run), run, run_logprobs))
        return segments

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def window_bounds(samples: np.ndarray, window: int, rate: int) -> list[tuple[int, int]]:
    """(start, end) sample indices of the windows a file is transcribed in: each at most `window` samples, cut at
    the quietest 20 ms (least mean square) within the last tenth of the window (at most 1 s) before its end, so a cut
    falls in a pause rather than a word where there is one."""
    frame = max(1, rate // 50)
    search = min(rate, window // 10)
    bounds: list[tuple[int, int]] = []
    start, total = 0, samples.shape[0]
    while total - start > window:
        low = start + window - search
        frames = (search - frame) // frame + 1
        if frames < 1:  # a window too short to search in
            end = start + window
        else:
            energy = np.square(samples[low: low + frames * frame].astype(np.float64)).reshape(frames, frame).mean(1)
            end = low + int(np.argmin(energy)) * frame + frame // 2
        bounds.append((start, end))
        start = end
    bounds.append((start, total))
    return bounds


def _generation_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except OSError:
        return {}


def _as_text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"{field} must be a text field, not a file")
    return value


def _text(form: Any, field: str) -> str | None:
    value = form.get(field)
    return None if value is None else _as_text(value, field)


def _boolean(form: Any, field: str) -> bool:
    value = _text(form, field)
    if value is None:
        return False
    if value.lower() not in ("true", "false"):
        raise InvalidRequestError(field, f"{field} must be true or false, got {value!r}")
    return value.lower() == "true"


def _temperature(form: Any) -> float:
    value = _text(form, "temperature")
    if value is None:
        return 0.0
    try:
        temperature = float(value)
    except ValueError:
        raise InvalidRequestError("temperature", f"temperature must be a number, got {value!r}") from None
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 1.0:
        raise InvalidRequestError("temperature", f"temperature must be between 0 and 1, got {value!r}")
    return temperature


def _usage(duration: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(duration)}


def _sse(event: dict[str, Any]) -> str:
    return sse(json.dumps(event))


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def _srt(segments: list[Segment]) -> str:
    return "".join(f"{i + 1}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(segments))


def _vtt(segments: list[Segment]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments)


# Whisper's no-speech token: <|nospeech|> in large-v3, <|nocaptions|> before it.
NO_SPEECH_TOKENS = ("<|nospeech|>", "<|nocaptions|>")


def _special_token_id(tokenizer: Any, tokens: tuple[str, ...]) -> int | None:
    vocab = tokenizer.get_vocab()
    return next((int(vocab[t]) for t in tokens if t in vocab), None)


def _token_logprobs(completion: Any) -> list[float]:
    """The sampled tokens' log probabilities of a completion asked with logprobs=0 (empty without them)."""
    if completion.logprobs is None:
        return []
    return [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def compression_ratio(text: str) -> float:
    """The text's UTF-8 bytes over its zlib-compressed bytes (Whisper's repetition measure)."""
    data = text.encode("utf-8")
    return round(len(data) / len(zlib.compress(data)), 6)


def _language_name(code: str | None) -> str | None:
    """The language as OpenAI's verbose_json names it ("english"), from Whisper's code ("en")."""
    if not code:
        return code
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES.get(code, code)
