"""/v1/responses (the Responses API's text subset) through the official `openai` client: the tiny random Llama
for text, structured outputs and forced calls (each equal to the equivalent chat completion's greedy answer), the
scripted model for tool calls, and the refusals by name."""

import json

import pytest
from http_client import HTTP

MODEL = "tiny"
INSTRUCTIONS = "Be brief."
GREEDY = {"max_output_tokens": 8, "temperature": 0.0}
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          "response.output_text.delta", "response.output_text.done", "response.content_part.done",
          "response.output_item.done", "response.completed"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def client(openai_server):
    return openai_server.client()


def chat_text(client, messages, **kwargs) -> str:
    return client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0.0,
                                          **kwargs).choices[0].message.content


def test_text_input_equals_the_chat_completion(client):
    response = client.responses.create(model=MODEL, input="Hello there", instructions=INSTRUCTIONS, **GREEDY)
    expected = chat_text(client, [{"role": "system", "content": INSTRUCTIONS},
                                  {"role": "user", "content": "Hello there"}])
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == expected
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert item.status == response.status  # a message cut at max_output_tokens is incomplete too
    assert response.usage.output_tokens <= 8 and response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens)
    if response.usage.output_tokens == 8:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 8


def test_the_response_reports_the_sampling_it_used_and_the_reasoning_asked(openai_server, client):
    """temperature and top_p left out are reported as the values used (the model's generation_config, else
    SamplingParams' defaults); a reasoning effort asked for is echoed."""
    from kestrel.sampling_params import SamplingParams

    defaults = openai_server.engine.generation_defaults.sampling
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert plain.temperature == defaults.get("temperature", SamplingParams.default("temperature"))
    assert plain.top_p == defaults.get("top_p", SamplingParams.default("top_p")) and plain.reasoning is None
    asked = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0.5, top_p=0.8,
                                    reasoning={"effort": "low"})
    assert (asked.temperature, asked.top_p, asked.reasoning.effort) == (0.5, 0.8, "low")


def test_streams_give_the_event_sequence_and_the_same_text(client):
    args = {"model": MODEL, "input": "Hello there", "instructions": INSTRUCTIONS, **GREEDY}
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert _collapsed(kinds) == EVENTS
    assert final.status == whole.status and final.output[0].status == whole.output[0].status
    assert final.output_text == whole.output_text == "".join(e.delta for e in events if e.type.endswith("delta"))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = list(client.responses.create(stream=True, **args))  # deltas group tokens as the engine's outputs come
    assert _collapsed([e.type for e in raw]) == EVENTS
    assert "".join(e.delta for e in raw if e.type.endswith("delta")) == whole.output_text


def test_output_text_logprobs_are_the_chat_completions_whole_and_streamed(client):
    """include ["message.output_text.logprobs"] with top_logprobs: the output text's tokens with their logprobs
    and alternatives, equal to the chat completion's of the same greedy answer; the stream's deltas carry them
    piecewise and its done events whole."""
    args = {"model": MODEL, "input": "Hello there", "instructions": INSTRUCTIONS, **GREEDY,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = client.responses.create(**args)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Hello there"}],
        max_completion_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    part = whole.output[0].content[0]
    assert whole.top_logprobs == 2 and len(part.logprobs) == len(chat) == whole.usage.output_tokens
    for ours, theirs in zip(part.logprobs, chat):
        assert (ours.token, ours.bytes) == (theirs.token, theirs.bytes)
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)
        assert [t.token for t in ours.top_logprobs] == [t.token for t in theirs.top_logprobs]
    assert "".join(bytes(t.bytes).decode("utf-8", "replace") for t in part.logprobs) == whole.output_text
    events = list(client.responses.create(stream=True, **args))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [t.token for t in streamed] == [t.token for t in done.logprobs] == [t.token for t in part.logprobs]
    plain = client.responses.create(model=MODEL, input="Hello there", **GREEDY)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 0  # none unless asked for


def _collapsed(kinds: list[str]) -> list[str]:
    """The event types with each run of deltas as one."""
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


def test_message_items_with_replayed_output_equal_the_chat_completion(client):
    first = client.responses.create(model=MODEL, input="Hi", **GREEDY)
    history = [{"role": "developer", "content": "Answer in English."},
               {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               *[item.model_dump(exclude_none=True) for item in first.output],  # the client's replay of its output
               {"role": "user", "content": "And then?"}]
    response = client.responses.create(model=MODEL, input=history, **GREEDY)
    expected = chat_text(client, [{"role": "developer", "content": "Answer in English."},
                                  {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "And then?"}])
    assert response.output_text == expected


def test_text_format_json_schema_is_the_chat_response_format(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Pick a colour", max_output_tokens=40, temperature=0.0,
                                       text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    expected = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a colour"}], max_completion_tokens=40,
        temperature=0.0, response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    assert response.output_text == expected.choices[0].message.content
    if response.status == "completed":
        assert json.loads(response.output_text)["colour"] in ("red", "blue")


def test_a_named_function_forces_the_call(scripted):
    server, runner = scripted
    client = server.client()
    runner.script = '{"city": "Oslo"}}'  # the server started the call; the model writes only the arguments
    try:
        args = {"model": MODEL, "input": "Weather in Oslo?", "tools": [WEATHER],
                "tool_choice": {"type": "function", "name": "get_weather"}}
        (call,) = client.responses.create(**args).output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Oslo"}
        with client.responses.stream(**args) as stream:
            final = stream.get_final_response()
        assert final.output[0].name == "get_weather" and json.loads(final.output[0].arguments) == {"city": "Oslo"}
    finally:
        runner.script = "Hello!"


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item_whole_and_streamed(scripted):
    """A forced call whose arguments max_output_tokens cut: the response and the call item are incomplete."""
    server, runner = scripted
    client = server.client()
    runner.script = '{"city": "Oslo and more words than fit"}}'
    try:
        args = {"model": MODEL, "input": "Weather in Oslo?", "tools": [WEATHER], "max_output_tokens": 4,
                "tool_choice": {"type": "function", "name": "get_weather"}}
        whole = client.responses.create(**args)
        with client.responses.stream(**args) as stream:
            done = [e.item for e in stream if e.type == "response.output_item.done"]
            final = stream.get_final_response()
        for response in (whole, final):
            assert response.status == "incomplete"
            assert [(item.type, item.status) for item in response.output] == [("function_call", "incomplete")]
        assert [item.status for item in done] == ["incomplete"]
    finally:
        runner.script = "Hello!"


def test_tool_round_trip_on_the_scripted_model(scripted):
    server, runner = scripted
    client = server.client()
    runner.script = CALL
    try:
        response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
        (call,) = response.output
        assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
        with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[WEATHER]) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        assert json.loads(final.output[0].arguments) == {"city": "Paris"}
        runner.script = "Sunny."
        follow = client.responses.create(model=MODEL, tools=[WEATHER], input=[
            {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        assert follow.output_text == "Sunny."
    finally:
        runner.script = "Hello!"


@pytest.mark.parametrize(("body", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),  # alternatives to logprobs not asked for
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters"),
])
def test_unsupported_fields_are_refused_by_name(openai_server, body, param):
    reply = HTTP.post(f"{openai_server.base_url}/v1/responses", headers=openai_server.headers,
                      json={"model": MODEL, "input": "Hi", **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param), reply.json()
    assert "token ids" not in reply.json()["error"]["message"]  # the words of the completions' prompt
    if param == "reasoning.summary":
        assert "leave reasoning.summary out" in reply.json()["error"]["message"]
