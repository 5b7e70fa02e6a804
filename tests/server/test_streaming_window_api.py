"""Attention sinks + window (--streaming-window) through the OpenAI API: a streamed completion three times the
context in bounded KV, the prompt held to sinks + window, max_tokens held to --max-streaming-tokens, a chat without
max_tokens stopping at the context; without the flag, max_tokens stays within max_model_len."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from conftest import API_KEY, MODEL, LiveServer
from http_client import HTTP

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app

CONTEXT = 128
SINKS, WINDOW = 4, 60
NUM_BLOCKS = 16
BOUND_BLOCKS = 1 + 4 + 2  # ceil(4 / 16) sink blocks + ceil(60 / 16) window blocks + 2 (docs/long-context.md)
MAX_STREAMING_TOKENS = 1000


@pytest.fixture(scope="module")
def streaming_server(tiny_model_dir: str) -> Iterator[LiveServer]:
    engine = AsyncEngine.from_args(tiny_model_dir, max_model_len=CONTEXT, max_num_seqs=4, device="cpu",
                                   dtype="float32", kv_cache_blocks=NUM_BLOCKS,
                                   streaming_window={"sink_tokens": SINKS, "window": WINDOW}).start()
    server = LiveServer(build_app(engine, MODEL, api_key=API_KEY, max_streaming_tokens=MAX_STREAMING_TOKENS),
                        engine)
    yield server
    server.stop()


def _prompt(n: int) -> list[int]:
    return [(i * 104729) % 250 + 3 for i in range(n)]


def test_streamed_completion_three_times_the_context(streaming_server: LiveServer) -> None:
    client = streaming_server.client()
    max_tokens = 3 * CONTEXT
    stream = client.completions.create(model=MODEL, prompt=_prompt(20), max_tokens=max_tokens, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    token_ids: list[int] = []
    finish_reasons, usage, peak = [], None, 0.0
    for i, chunk in enumerate(stream):
        for choice in chunk.choices:
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
        if i % 16 == 0:
            peak = max(peak, streaming_server.metrics()["kestrel:kv_cache_usage_perc"])
    assert len(token_ids) == max_tokens and finish_reasons == ["length"]
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (20, max_tokens)
    assert usage.total_tokens == 20 + max_tokens
    # 404 tokens would take 26 blocks of a 16-block pool; the stream holds at most the sinks' and window's
    assert 0 < peak <= BOUND_BLOCKS / NUM_BLOCKS < 1
    samples = streaming_server.wait_idle()
    assert samples["kestrel:kv_cache_usage_perc"] == 0
    health = HTTP.get(f"{streaming_server.base_url}/health", headers=streaming_server.headers)
    assert health.status_code == 200


def test_prompt_longer_than_sinks_plus_window(streaming_server: LiveServer) -> None:
    client = streaming_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=_prompt(SINKS + WINDOW + 1), max_tokens=4)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "prompt"
    assert "--streaming-window" in error["message"] and f"at most {SINKS + WINDOW} tokens" in error["message"]
    # a prompt of exactly sinks + window tokens streams on past the context
    out = client.completions.create(model=MODEL, prompt=_prompt(SINKS + WINDOW), max_tokens=CONTEXT,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == CONTEXT and out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": " ".join(["word"] * 200)}])
    assert caught.value.body["param"] == "messages" and "--streaming-window" in caught.value.body["message"]


def test_max_tokens_bounded_by_max_streaming_tokens(streaming_server: LiveServer) -> None:
    client = streaming_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=_prompt(5), max_tokens=MAX_STREAMING_TOKENS + 1)
    assert caught.value.body["param"] == "max_tokens" and "--max-streaming-tokens" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_completion_tokens=MAX_STREAMING_TOKENS + 1,
                                       messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["param"] == "max_completion_tokens"


def test_chat_without_max_tokens_stops_at_the_context(streaming_server: LiveServer) -> None:
    out = streaming_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == CONTEXT


def test_without_the_flag_max_tokens_stays_within_the_context(openai_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_server.client().completions.create(model=MODEL, prompt=_prompt(5), max_tokens=1000)
    assert caught.value.body["param"] == "max_tokens" and "max_model_len=256" in caught.value.body["message"]
