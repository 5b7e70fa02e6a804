"""Audio through the OpenAI API on a tiny random Qwen2-Audio (tests/audio_checkpoints.py): the openai client's
`input_audio` (WAV, MP3) and vLLM's `audio_url` get LLM.chat's greedy text; every bad audio part a 400 naming it
(undecodable, bad base64, unsupported format, over the server's --max-audio-seconds or the model's window, more
clips than --limit-mm-per-prompt, an image to this model, audio to a text-only one)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, MODEL, LiveServer
from http_client import HTTP

from kestrel import LLM, SamplingParams
from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from audio_checkpoints import clip, wav_bytes, write_qwen2_audio  # noqa: E402

MAX_NEW = 6


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this sound?"}]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_qwen2_audio(tmp_path_factory.mktemp("qwen2-audio-api"), seed=7)


@pytest.fixture(scope="module")
def server(checkpoint) -> Iterator[LiveServer]:
    engine = AsyncEngine.from_args(str(checkpoint), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
                                   device="cpu", dtype="float32", limit_mm_per_prompt={"audio": 2}).start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY, max_audio_seconds=2.0), engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32", max_model_len=256)


def chat(server: LiveServer, messages: list[dict]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_NEW, "temperature": 0}
    return HTTP.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)


def offline(llm: LLM, messages: list[dict]):
    return llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)[0]


def test_openai_client_input_audio_matches_llm_chat(server, llm) -> None:
    for messages in (user(audio_part(wav_bytes(clip(1, 0.6)))),
                     user(audio_part(wav_bytes(clip(2, 0.3, 22050), 22050, fmt="MP3"), "mp3"),
                          audio_part(wav_bytes(clip(3, 0.8, 8000), 8000, fmt="FLAC"), "flac"))):
        reply = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW,
                                                        temperature=0)
        expected = offline(llm, messages)
        assert reply.choices[0].message.content == expected.outputs[0].text
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    one = server.client().chat.completions.create(model=MODEL, messages=user(audio_part(wav_bytes(clip(1, 0.6)))),
                                                  max_tokens=MAX_NEW, temperature=0)
    assert one.usage.prompt_tokens > 15  # the clip's 15 placeholder tokens are part of the prompt


def test_audio_url_part_is_the_same_clip(server) -> None:
    data = wav_bytes(clip(4, 0.5))
    by_part = chat(server, user(audio_part(data)))
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(data).decode()}}
    by_url = chat(server, user(url))
    assert by_part.status_code == by_url.status_code == 200, by_url.text
    assert by_url.json()["choices"][0]["message"]["content"] == by_part.json()["choices"][0]["message"]["content"]


def assert_400(response: httpx.Response, param: str, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


def test_bad_audio_parts_are_400s_naming_the_part(server) -> None:
    part = "messages[0].content[0].input_audio"
    assert_400(chat(server, user(audio_part(b"RIFF not really a wav"))), f"{part}.data", "could not be decoded")
    bad_base64 = {"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}
    assert_400(chat(server, user(bad_base64)), f"{part}.data", "not valid base64")
    assert_400(chat(server, user(audio_part(wav_bytes(clip(1, 0.2)), "ogg"))), f"{part}.format",
               "unsupported audio format")
    assert_400(chat(server, user(audio_part(wav_bytes(clip(1, 2.5))))), f"{part}.data", "more than this server's 2 s")
    assert_400(chat(server, user(audio_part(wav_bytes(clip(1, 1.5))))), f"{part}.data", "at most 1 s a clip")
    three = [audio_part(wav_bytes(clip(k, 0.2))) for k in range(3)]
    assert_400(chat(server, user(*three)), "messages", "at most 2")
    url = {"type": "audio_url", "audio_url": {"url": "data:text/plain;base64,AAAA"}}
    assert_400(chat(server, user(url)), "messages[0].content[0].audio_url", "data:audio/")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert_400(chat(server, user(image)), "messages[0].content[0]", "does not take image input")
    good = chat(server, user(audio_part(wav_bytes(clip(1, 0.6)))))
    assert good.status_code == 200  # the engine lives on


def test_audio_part_to_a_text_only_model_is_refused(openai_server) -> None:
    assert_400(chat(openai_server, user(audio_part(wav_bytes(clip(1, 0.2))))), "messages[0].content[0]", "text only")
