"""litellm against `kestrel serve` as its `hosted_vllm` provider: completion (plain, streamed, with tools, with a
pydantic response_format), text_completion and acompletion."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from .support import USER, WEATHER, Pick, Served, check_weather_call


@pytest.fixture(scope="module")
def litellm() -> Iterator[ModuleType]:
    """litellm, imported with its bundled model cost map: by default the import fetches the map from GitHub."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        yield importlib.import_module("litellm")


@pytest.fixture(scope="module")
def args(served: Served) -> dict[str, Any]:
    return {"model": f"hosted_vllm/{served.model}", "api_base": served.v1, "api_key": served.api_key,
            "temperature": 0, "num_retries": 0, "timeout": 60}


def test_completion_plain_streamed_and_async(litellm: ModuleType, served: Served, args: dict[str, Any]) -> None:
    expected = served.post("chat/completions", {"messages": USER, "max_tokens": 12, "temperature": 0})
    text = expected["choices"][0]["message"]["content"]
    reply = litellm.completion(messages=USER, max_tokens=12, **args)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == expected["usage"]["prompt_tokens"] and reply.usage.completion_tokens == 12
    chunks = list(litellm.completion(messages=USER, max_tokens=12, stream=True,
                                     stream_options={"include_usage": True}, **args))
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == text
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
    usage = [chunk.usage for chunk in chunks if getattr(chunk, "usage", None)]
    assert usage and usage[-1].completion_tokens == 12
    assert usage[-1].prompt_tokens == expected["usage"]["prompt_tokens"]
    async_reply = asyncio.run(litellm.acompletion(messages=USER, max_tokens=12, **args))
    assert async_reply.choices[0].message.content == text


def test_tools(litellm: ModuleType, args: dict[str, Any]) -> None:
    reply = litellm.completion(messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=100, **args)
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    check_weather_call(call.function.name, call.function.arguments)


def test_pydantic_response_format(litellm: ModuleType, args: dict[str, Any]) -> None:
    reply = litellm.completion(messages=[{"role": "user", "content": "Pick one"}], response_format=Pick,
                               max_tokens=200, **args)
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].message.content
    assert Pick.model_validate_json(content).model_dump() == json.loads(content)


def test_text_completion(litellm: ModuleType, served: Served, args: dict[str, Any]) -> None:
    prompt = "def fibonacci(n):"
    expected = served.post("completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    reply = litellm.text_completion(prompt=prompt, max_tokens=8, **args)
    assert reply.choices[0].text == expected["choices"][0]["text"]
    assert reply.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
