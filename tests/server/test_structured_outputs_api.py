"""Structured outputs through the API on kestrel-tiny: response_format (json_object, json_schema), vLLM's
structured_outputs and guided_* fields on both endpoints, forced tool calls, and the official openai client's
`beta.chat.completions.parse` with a pydantic model; every constrained answer validates (jsonschema)."""

import json
import re
from typing import Literal

import jsonschema
import pydantic
import pytest
from conftest import API_KEY, LiveServer
from http_client import HTTP

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app

MODEL = "kestrel-tiny"
LANGUAGE = {
    "type": "object",
    "properties": {"language": {"enum": ["python", "c", "rust"]}, "typed": {"type": "boolean"},
                   "name": {"type": "string", "maxLength": 8}},
    "required": ["language", "typed", "name"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine.from_args(str(_bundled()), max_model_len=512, max_num_seqs=16, device="cpu",
                                   async_scheduling=True).start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine, model=MODEL)
    yield live
    live.stop()


def _bundled():
    from kestrel.tiny import default_model_path

    return default_model_path()


def post(server, path, body):
    return HTTP.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, headers=server.headers, timeout=120)


def chat(content: str, **fields):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 160, **fields}


@pytest.mark.parametrize("seed, temperature", [(0, 0.0), (1, 0.8), (2, 1.2)])
def test_response_format_json_schema_answers_validate(server, seed, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "language", "schema": LANGUAGE, "strict": True}}
    reply = post(server, "/v1/chat/completions", chat("Describe a language.", response_format=fmt, seed=seed,
                                                      temperature=temperature))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), LANGUAGE)


def test_json_object_and_structured_outputs_on_completions(server):
    reply = post(server, "/v1/completions", {"prompt": "config = ", "max_tokens": 200, "temperature": 0.0,
                                             "response_format": {"type": "json_object"}})
    text = reply.json()["choices"][0]["text"]
    if reply.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")
    choice = post(server, "/v1/completions", {"prompt": "The answer is", "max_tokens": 8, "seed": 4,
                                              "temperature": 1.0, "structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.json()["choices"][0]["text"] in ("yes", "no")
    regex = post(server, "/v1/chat/completions", chat("A version.", guided_regex=r"v\d\.\d{1,2}", temperature=1.0))
    assert re.fullmatch(r"v\d\.\d{1,2}", regex.json()["choices"][0]["message"]["content"])


def test_streamed_constrained_answer_is_the_same_json(server):
    body = chat("A language.", temperature=0.0, structured_outputs={"json": LANGUAGE})
    whole = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    with HTTP.stream("POST", f"{server.base_url}/v1/chat/completions", json={"model": MODEL, **body, "stream": True},
                     headers=server.headers, timeout=120) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), LANGUAGE)


def test_bad_grammars_and_conflicts_are_400s_naming_the_field(server):
    bad = post(server, "/v1/chat/completions", chat("x", structured_outputs={"regex": "(open"}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs.regex"
    schema = post(server, "/v1/chat/completions",
                  chat("x", response_format={"type": "json_schema", "json_schema": {"name": "n"}}))
    assert schema.status_code == 400 and schema.json()["error"]["param"] == "response_format.json_schema"
    both = post(server, "/v1/completions", {"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}})
    assert both.status_code == 400 and both.json()["error"]["param"] in ("guided_regex", "structured_outputs")
    backend = post(server, "/v1/completions",
                   {"prompt": "x", "guided_regex": "a", "guided_decoding_backend": "outlines"})
    assert backend.status_code == 400 and backend.json()["error"]["param"] == "guided_decoding_backend"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("seed", [0, 1])
def test_forced_tool_calls_are_valid_calls(server, tool_choice, seed):
    reply = post(server, "/v1/chat/completions", chat("What is the weather in Paris?", tools=[WEATHER, TIME],
                                                      tool_choice=tool_choice, seed=seed, temperature=1.0))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    name = call["function"]["name"]
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


class Language(pydantic.BaseModel):
    language: Literal["python", "c", "rust"]
    typed: bool


def test_openai_client_parse_with_a_pydantic_model(server):
    client = server.client()
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Which language?"}], response_format=Language,
        max_tokens=120, temperature=0.0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Language)
