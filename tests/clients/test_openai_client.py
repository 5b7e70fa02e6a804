"""The official `openai` client against `kestrel serve`: chat (streamed with usage), `parse` with a pydantic model,
tools, completions with logprobs, the Responses API (create, stream, parse) and embeddings. tests/server covers
these endpoints field by field in-process; here each is checked once through a real server process."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import openai
import pytest
import torch

from .support import USER, WEATHER, HFModel, Pick, Served, check_weather_call


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.v1, api_key=served.api_key, max_retries=0, timeout=60)


def test_chat_stream_with_usage_equals_the_plain_reply(client: openai.OpenAI, served: Served,
                                                       hf_model: HFModel) -> None:
    tokenizer, _ = hf_model
    prompt_tokens = len(tokenizer.encode(tokenizer.apply_chat_template(USER, tokenize=False,
                                                                       add_generation_prompt=True),
                                         add_special_tokens=False))
    plain = client.chat.completions.create(model=served.model, messages=USER, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content == served.post(
        "chat/completions", {"messages": USER, "max_tokens": 12, "temperature": 0})["choices"][0]["message"]["content"]
    assert plain.usage.prompt_tokens == prompt_tokens and plain.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=served.model, messages=USER, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_parse_fills_the_pydantic_model(client: openai.OpenAI, served: Served) -> None:
    completion = client.chat.completions.parse(model=served.model, response_format=Pick, max_tokens=200,
                                               temperature=0, messages=[{"role": "user", "content": "Pick one"}])
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pick)
    assert message.parsed.model_dump() == json.loads(message.content)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_and_its_round_trip(client: openai.OpenAI, served: Served,
                                               tool_choice: str | dict[str, Any]) -> None:
    reply = client.chat.completions.create(model=served.model, messages=USER, tools=[WEATHER],
                                           tool_choice=tool_choice, max_tokens=100, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_weather_call(call.function.name, call.function.arguments)
    answer = client.chat.completions.create(
        model=served.model, tools=[WEATHER], max_tokens=8, temperature=0,
        messages=[*USER, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}])
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_completion_logprobs_equal_transformers(client: openai.OpenAI, served: Served, hf_model: HFModel) -> None:
    tokenizer, model = hf_model
    prompt = "def fibonacci(n):"
    reply = client.completions.create(model=served.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                      echo=True)
    prompt_ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0]
        logprobs = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), dim=-1)
    expected = logprobs.gather(1, ids[1:, None])[:, 0].tolist()
    choice = reply.choices[0]
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_responses_create_stream_and_parse(client: openai.OpenAI, served: Served) -> None:
    chat = served.post("chat/completions", {"messages": USER, "max_tokens": 10, "temperature": 0})
    created = client.responses.create(model=served.model, input=USER[0]["content"], max_output_tokens=10,
                                      temperature=0)
    assert created.status == "incomplete" and created.incomplete_details.reason == "max_output_tokens"
    assert created.output_text == chat["choices"][0]["message"]["content"]
    assert created.usage.input_tokens == chat["usage"]["prompt_tokens"] and created.usage.output_tokens == 10
    with client.responses.stream(model=served.model, input=USER[0]["content"], max_output_tokens=10,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[0].type == "response.created"
    # A response cut short ends with response.completed, as vLLM sends it (the openai client's get_final_response()
    # needs that event: it raises on a stream that ends with response.incomplete), its status saying why it ended
    assert events[-1].type == "response.completed"
    assert events[-1].response.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == created.output_text
    assert final.output_text == created.output_text
    parsed = client.responses.parse(model=served.model, input="Pick one", text_format=Pick, max_output_tokens=200,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Pick) and parsed.status == "completed"
    assert parsed.output_parsed.model_dump() == json.loads(parsed.output_text)


def test_embeddings_equal_transformers(client: openai.OpenAI, served: Served,
                                      hf_embed: Callable[[str], np.ndarray]) -> None:
    texts = ["The quick brown fox", "kestrel"]
    for encoding in ({"encoding_format": "float"}, {}):  # without a format the client asks for base64 and decodes it
        reply = client.embeddings.create(model=served.model, input=texts, **encoding)
        assert [d.index for d in reply.data] == [0, 1]
        for data, text in zip(reply.data, texts):
            assert np.allclose(data.embedding, hf_embed(text), atol=1e-5)
