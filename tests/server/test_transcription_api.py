"""/v1/audio/transcriptions and /v1/audio/translations on a tiny random Whisper (tests/audio_checkpoints.py) through
the official openai client: the text equals LLM.generate's greedy output for the same forced decoder tokens (a clip
longer than the model's 1 s window: its windows' texts joined), every response_format (segment timestamps from the
timestamp tokens in verbose_json, srt and vtt), streaming SSE events, and each bad field a 400 naming it; a model
that does not transcribe refuses the endpoints by name."""

from __future__ import annotations

import json
import shutil
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
import torch
import transformers
from conftest import API_KEY, MODEL, LiveServer, serve_process
from http_client import HTTP
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from kestrel import LLM, SamplingParams
from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.media import MediaLimits, decode_audio
from kestrel.entrypoints.server import build_app
from kestrel.entrypoints.serving_audio import window_bounds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from audio_checkpoints import SAMPLE_RATE, clip, separate_languages, wav_bytes, write_whisper  # noqa: E402

MAX_TOKENS = 60  # max_target_positions 64 less the forced tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = write_whisper(tmp_path_factory.mktemp("whisper-api"), seed=3)
    return separate_languages(path, [clip(seed, 0.5) for seed in (21, 22, 23)])


@pytest.fixture(scope="module")
def server(checkpoint) -> Iterator[LiveServer]:
    engine = AsyncEngine.from_args(str(checkpoint), max_num_seqs=8, device="cpu", dtype="float32").start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32")


def forced(llm: LLM, *tokens: str) -> list[int]:
    return llm.tokenizer.convert_tokens_to_ids(list(tokens))


def offline(llm: LLM, prompt_ids: list[int], samples, rate: int = SAMPLE_RATE, fmt: str = "WAV",
            logprobs: int | None = None):
    """LLM's greedy output for the clip as the server hears it (written as a 16-bit file, decoded again)."""
    audio = decode_audio(wav_bytes(samples, rate, fmt=fmt), "file", MediaLimits())
    params = SamplingParams(temperature=0.0, max_tokens=64 - len(prompt_ids), logprobs=logprobs)
    prompt = {"prompt_token_ids": prompt_ids, "multi_modal_data": {"audio": (audio.samples, audio.rate)}}
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def upload(samples, rate: int = SAMPLE_RATE, fmt: str = "WAV") -> tuple[str, bytes]:
    return (f"clip.{fmt.lower()}", wav_bytes(samples, rate, fmt=fmt))


def post(server: LiveServer, path: str, data: dict, file: tuple[str, bytes] | None) -> httpx.Response:
    files = {"file": file} if file is not None else None
    return HTTP.post(f"{server.base_url}/v1/audio/{path}", data=data, files=files, headers=server.headers,
                     timeout=60)


def test_transcription_and_translation_match_offline_greedy(server, llm) -> None:
    client = server.client()
    samples = clip(11, 0.7)
    expected = offline(llm, forced(llm, "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"),
                       samples).text
    reply = client.audio.transcriptions.create(model=MODEL, file=upload(samples), language="en", temperature=0)
    assert reply.text == expected
    # The language and the task change the forced tokens; an 8 kHz FLAC is resampled first.
    low = clip(12, 0.5, 8000)
    german = offline(llm, forced(llm, "<|startoftranscript|>", "<|de|>", "<|translate|>", "<|notimestamps|>"),
                     low, 8000, "FLAC").text
    reply = client.audio.translations.create(model=MODEL, file=upload(low, 8000, "FLAC"), extra_body={"language": "de"})
    assert reply.text == german
    assert german != expected
    # A previous-text prompt goes first, after <|startofprev|>.
    prompted = offline(llm, [*forced(llm, "<|startofprev|>"), *llm.tokenizer.encode(" the cat",
                                                                                   add_special_tokens=False),
                             *forced(llm, "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")],
                       samples).text
    reply = client.audio.transcriptions.create(model=MODEL, file=upload(samples), language="en", prompt="the cat")
    assert reply.text == prompted


def test_the_language_is_detected_as_transformers_detects_it(server, llm, checkpoint) -> None:
    """Without `language`: one greedy step after <|startoftranscript|> over the language tokens, as transformers'
    detect_language; the transcript then uses that language's token."""
    model = transformers.WhisperForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(str(checkpoint))
    codes = {llm.tokenizer.convert_tokens_to_ids(f"<|{c}|>"): c for c in ("en", "de", "fr")}
    seen = set()
    for seed in range(21, 29):
        samples = clip(seed, 0.5)
        audio = decode_audio(wav_bytes(samples), "file", MediaLimits())
        features = extractor(audio.samples, sampling_rate=SAMPLE_RATE, return_tensors="pt")["input_features"]
        with torch.no_grad():
            language = codes[int(model.eval().detect_language(input_features=features)[0])]
        seen.add(language)
        reply = server.client().audio.transcriptions.create(model=MODEL, file=upload(samples),
                                                            response_format="verbose_json")
        assert reply.language == LANGUAGES[language]
        assert reply.text == offline(llm, forced(llm, "<|startoftranscript|>", f"<|{language}|>", "<|transcribe|>"),
                                     samples).text
    assert len(seen) > 1  # the clips are heard in different languages


def test_windows_are_cut_in_the_quietest_place_near_their_end() -> None:
    rate, window = 16000, 16000
    samples = clip(30, 3.5)
    samples[int(0.95 * rate): int(0.97 * rate)] = 0.0  # a pause 50 ms before the first window's end
    bounds = window_bounds(samples, window, rate)
    assert bounds[0] == (0, bounds[1][0]) and int(0.95 * rate) <= bounds[0][1] <= int(0.97 * rate)
    assert all(end - start <= window and end > start for start, end in bounds)
    assert [b[0] for b in bounds[1:]] == [b[1] for b in bounds[:-1]] and bounds[-1][1] == samples.size
    # Without a pause the cut still lies within the last tenth of the window.
    noise = clip(31, 2.5)
    assert all(window - window // 10 <= end - start <= window for start, end in window_bounds(noise, window, rate)[:-1])
    assert window_bounds(noise[:window], window, rate) == [(0, window)]


def test_a_clip_longer_than_the_window_is_transcribed_in_windows(server, llm) -> None:
    samples = clip(13, 2.4)  # 2.4 s through a 1 s window: three windows
    heard = decode_audio(wav_bytes(samples), "file", MediaLimits()).samples
    bounds = window_bounds(heard, SAMPLE_RATE, SAMPLE_RATE)
    assert len(bounds) == 3
    prompt = forced(llm, "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")
    params = SamplingParams(temperature=0.0, max_tokens=64 - len(prompt))
    windows = [{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (heard[a:b], SAMPLE_RATE)}}
               for a, b in bounds]
    expected = "".join(o.outputs[0].text for o in llm.generate(windows, params, use_tqdm=False))
    text = server.client().audio.transcriptions.create(model=MODEL, file=upload(samples), language="en",
                                                       response_format="text")
    assert text == expected


def test_response_formats_and_segments(server, llm, checkpoint) -> None:
    client = server.client()
    samples = clip(14, 0.9)
    timed = offline(llm, forced(llm, "<|startoftranscript|>", "<|en|>", "<|transcribe|>"), samples, logprobs=0)
    begin = llm.tokenizer.convert_tokens_to_ids("<|0.00|>")
    verbose = client.audio.transcriptions.create(model=MODEL, file=upload(samples), language="en",
                                                 response_format="verbose_json", timestamp_granularities=["segment"])
    assert verbose.text == timed.text and verbose.language == "english"
    assert abs(verbose.duration - 0.9) < 1e-3
    tokens = [t for s in verbose.segments for t in s.tokens]
    assert tokens == [t for t in timed.token_ids if t < begin and t != llm.tokenizer.convert_tokens_to_ids(
        "<|endoftext|>")][: len(tokens)]
    assert verbose.segments and all(0 <= s.start <= s.end <= 0.9 for s in verbose.segments)
    # avg_logprob: the mean of the segment's tokens' log probabilities offline; compression_ratio: zlib's
    text_logprobs = [step[t].logprob for t, step in zip(timed.token_ids, timed.logprobs) if t < begin]
    for segment in verbose.segments:
        mine = text_logprobs[: len(segment.tokens)]
        text_logprobs = text_logprobs[len(segment.tokens):]
        assert segment.avg_logprob == pytest.approx(sum(mine) / len(mine), abs=1e-5)
        data = segment.text.encode()
        assert segment.compression_ratio == pytest.approx(len(data) / len(zlib.compress(data)), abs=1e-5)
    # no_speech_prob: transformers' probability of <|nospeech|> after <|startoftranscript|>, on the clip as heard
    model = transformers.WhisperForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(str(checkpoint))
    audio = decode_audio(wav_bytes(samples), "file", MediaLimits())
    features = extractor(audio.samples, sampling_rate=SAMPLE_RATE, return_tensors="pt")["input_features"]
    with torch.no_grad():
        logits = model.eval()(input_features=features,
                              decoder_input_ids=torch.tensor([forced(llm, "<|startoftranscript|>")])).logits
    want = torch.softmax(logits[0, -1].double(), -1)[llm.tokenizer.convert_tokens_to_ids("<|nospeech|>")]
    assert all(s.no_speech_prob == pytest.approx(float(want), rel=1e-3, abs=1e-6) for s in verbose.segments)
    srt = client.audio.transcriptions.create(model=MODEL, file=upload(samples), language="en", response_format="srt")
    vtt = client.audio.transcriptions.create(model=MODEL, file=upload(samples), language="en", response_format="vtt")
    assert srt.startswith("1\n00:00:") and " --> " in srt
    assert vtt.startswith("WEBVTT\n\n00:00:")
    assert len(srt.strip().split("\n\n")) == len(verbose.segments) == len(vtt.strip().split("\n\n")) - 1
    plain = client.audio.transcriptions.create(model=MODEL, file=upload(samples), language="en", response_format="json")
    assert plain.text == offline(llm, forced(llm, "<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                             "<|notimestamps|>"), samples).text


def test_streaming_sends_text_deltas_then_done(server, llm) -> None:
    samples = clip(15, 0.6)
    expected = offline(llm, forced(llm, "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"),
                       samples).text
    events = list(server.client().audio.transcriptions.create(model=MODEL, file=upload(samples), language="en",
                                                              stream=True))
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    assert events[-1].type == "transcript.text.done" and events[-1].text == expected
    assert "".join(e.delta for e in events[:-1]) == expected


@pytest.mark.parametrize("data, file, param", [
    ({"model": MODEL}, ("clip.wav", b"RIFF not audio at all"), "file"),
    ({"model": MODEL}, None, "file"),
    ({"model": MODEL, "response_format": "xml"}, "ok", "response_format"),
    ({"model": MODEL, "timestamp_granularities[]": "word", "response_format": "verbose_json"}, "ok",
     "timestamp_granularities"),
    ({"model": MODEL, "timestamp_granularities[]": "segment"}, "ok", "timestamp_granularities"),
    ({"model": MODEL, "language": "xx"}, "ok", "language"),
    ({"model": MODEL, "temperature": "2"}, "ok", "temperature"),
    ({"model": MODEL, "temperature": "hot"}, "ok", "temperature"),
    ({"model": MODEL, "stream": "maybe"}, "ok", "stream"),
    ({"model": MODEL, "stream": "true", "response_format": "srt"}, "ok", "stream"),
    ({"model": MODEL, "chunking_strategy": "auto"}, "ok", "chunking_strategy"),
    ({"model": MODEL, "prompt": "x " * 200}, "ok", "prompt"),
])
def test_bad_fields_are_400s_naming_them(server, data, file, param) -> None:
    if file == "ok":
        file = upload(clip(16, 0.3))
    response = post(server, "transcriptions", data, file)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_translations_take_no_stream_and_unknown_models_are_404s(server) -> None:
    response = post(server, "translations", {"model": MODEL, "stream": "true"}, upload(clip(17, 0.3)))
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        server.client().audio.transcriptions.create(model="other", file=upload(clip(17, 0.3)))


def test_kestrel_serve_transcribes(checkpoint, llm) -> None:
    """The same through `kestrel serve` in its own process (tokenizer workers, the CLI's flags)."""
    samples = clip(20, 0.8)
    expected = offline(llm, forced(llm, "<|startoftranscript|>", "<|fr|>", "<|transcribe|>", "<|notimestamps|>"),
                       samples).text
    with serve_process(str(checkpoint), "--device", "cpu", "--tokenizer-workers", "0") as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
        reply = client.audio.transcriptions.create(model=MODEL, file=upload(samples), language="fr")
    assert reply.text == expected


def test_a_text_model_refuses_the_audio_endpoints(openai_server) -> None:
    for path in ("transcriptions", "translations"):
        response = HTTP.post(f"{openai_server.base_url}/v1/audio/{path}", data={"model": MODEL},
                             files={"file": upload(clip(18, 0.3))}, headers=openai_server.headers, timeout=30)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "model" and f"/v1/audio/{path}" in error["message"]




AUDIO_OPERATIONS = [("POST", "/v1/audio/transcriptions"), ("POST", "/v1/audio/translations")]
FUZZ_CASES = [(m, p, mode) for m, p in AUDIO_OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]


@pytest.mark.parametrize("method, path, mode", FUZZ_CASES, ids=[f"{p} {g.value}" for _, p, g in FUZZ_CASES])
def test_fuzzed_forms_never_fail_the_server(server, method, path, mode) -> None:
    """Schemathesis' forms of the documented fields (half of them with a real clip and the served model's name in
    place of the generated file bytes and name, so they reach the model): never a 5xx, every response as
    documented, every error naming its field."""
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=server.headers)
    operation = schema[path][method]
    clip_bytes = wav_bytes(clip(19, 0.2))

    @given(case=operation.as_strategy(generation_mode=mode), real_clip=st.booleans())
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def check(case, real_clip: bool) -> None:
        if real_clip and isinstance(case.body, dict) and "file" in case.body:
            case.body.update(file=clip_bytes, model=MODEL)
            if "language" in case.body:
                case.body["language"] = "en"
        response = case.call(headers=server.headers, timeout=120)
        assert response.status_code < 500, f"{case.path} -> {response.status_code}: {response.text[:500]}"
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"], error
        assert server.engine.is_healthy

    check()


def test_text_and_chat_endpoints_refuse_a_speech_model(server) -> None:
    for path, body in (("completions", {"prompt": "hello"}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "hello"}]})):
        response = HTTP.post(f"{server.base_url}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **body},
                             headers=server.headers, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and f"/v1/{path}" in error["message"]


def test_generation_config_suppress_tokens_are_honoured(checkpoint, llm, tmp_path) -> None:
    """A checkpoint whose generation_config.json suppresses tokens (as the published ones do): the endpoint never
    emits them and holds end-of-text back from the first position, giving transformers' generate's text (whose
    SuppressTokens and SuppressTokensAtBegin processors apply the same lists)."""
    samples = clip(16, 0.8)
    prompt = forced(llm, "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")
    free = offline(llm, prompt, samples).token_ids
    end = llm.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    suppressed = sorted({t for t in free if t != end})[:3]
    assert suppressed, "the unconstrained transcript has no text token to suppress"
    shutil.copytree(checkpoint, tmp_path / "m")
    for name in ("generation_config.json", "config.json"):  # transformers reads the model config's lists too
        config = json.loads((tmp_path / "m" / name).read_text())
        config.update(suppress_tokens=suppressed, begin_suppress_tokens=[end])
        (tmp_path / "m" / name).write_text(json.dumps(config))
    model = transformers.WhisperForConditionalGeneration.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(str(tmp_path / "m"))
    audio = decode_audio(wav_bytes(samples), "file", MediaLimits())
    features = extractor(audio.samples, sampling_rate=SAMPLE_RATE, return_tensors="pt")["input_features"]
    with torch.no_grad():
        out = model.eval().generate(input_features=features, language="en", task="transcribe",
                                    return_timestamps=False, do_sample=False, max_new_tokens=64 - len(prompt))
    sequence = out[0].tolist()
    sequence = sequence[len(prompt):] if sequence[: len(prompt)] == prompt else sequence  # with or without it
    generated = [t for t in sequence if t != end]
    assert not set(generated) & set(suppressed) and generated != [t for t in free if t != end]
    engine = AsyncEngine.from_args(str(tmp_path / "m"), max_num_seqs=2, device="cpu", dtype="float32").start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    try:
        reply = live.client().audio.transcriptions.create(model=MODEL, file=upload(samples), language="en")
    finally:
        live.stop()
    assert reply.text == llm.tokenizer.decode(generated, skip_special_tokens=True)


def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event(checkpoint) -> None:
    """The status line is sent before the first window runs: a failure after it (here the request timeout) travels
    as an error event, then [DONE], as on the other streaming endpoints."""
    engine = AsyncEngine.from_args(str(checkpoint), max_num_seqs=2, device="cpu", dtype="float32",
                                   request_timeout_s=1e-3).start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    try:
        with HTTP.stream("POST", f"{live.base_url}/v1/audio/transcriptions", headers=live.headers, timeout=60,
                         data={"model": MODEL, "language": "en", "stream": "true"},
                         files={"file": ("clip.wav", wav_bytes(clip(15, 0.6)), "audio/wav")}) as reply:
            assert reply.status_code == 200
            events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert live.wait_idle()["kestrel:num_requests_running"] == 0
    finally:
        live.stop()
