"""Tool calls end to end: the real server and engine with a scripted model that answers a fixed text."""

import json

import pytest
from http_client import HTTP

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}},
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "What's the weather in Paris?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a \\"quoted\\" {brace}"}}'


@pytest.fixture
def tools_server(scripted):
    server, runner = scripted
    runner.step_delay_s = 0.0
    yield server, runner
    runner.script = "Hello!"


def chat(server, **kwargs):
    return server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=128, **kwargs)


def reassemble(stream) -> tuple[dict[int, dict], str, list[str]]:
    calls: dict[int, dict] = {}
    content, finish = "", []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    return calls, content, finish


def test_auto_tool_call(tools_server):
    server, runner = tools_server
    runner.script = CALL
    choice = chat(server, tools=[WEATHER, ADD]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "note": 'a "quoted" {brace}'}


def test_streamed_tool_call_arguments_reassemble_into_json(tools_server):
    server, runner = tools_server
    runner.script = CALL
    calls, content, finish = reassemble(chat(server, tools=[WEATHER, ADD], stream=True))
    assert finish == ["tool_calls"] and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "note": 'a "quoted" {brace}'}


def test_streamed_parallel_calls(tools_server):
    server, runner = tools_server
    runner.script = ('[{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}, '
                     '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    calls, _, finish = reassemble(chat(server, tools=[WEATHER, ADD], stream=True))
    assert finish == ["tool_calls"]
    assert [calls[i]["name"] for i in sorted(calls)] == ["add", "get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"a": 1, "b": [2, 3]}
    assert json.loads(calls[1]["arguments"]) == {"city": "Rome"}
    single = chat(server, tools=[WEATHER, ADD], parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in single.message.tool_calls] == ["add"]


def test_plain_text_stays_content(tools_server):
    server, runner = tools_server
    runner.script = "It is sunny in Paris."
    choice = chat(server, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "It is sunny in Paris."
    assert not choice.message.tool_calls
    calls, content, finish = reassemble(chat(server, tools=[WEATHER], stream=True))
    assert calls == {} and content == "It is sunny in Paris." and finish == ["stop"]


def test_tool_choice_none_never_parses(tools_server):
    server, runner = tools_server
    runner.script = CALL
    choice = chat(server, tools=[WEATHER], tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == CALL


def test_named_function_forces_the_call_header(tools_server):
    server, runner = tools_server
    runner.script = '{"city": "Oslo"}}'  # the server started the call; the model writes only the arguments
    choice = chat(server, tools=[WEATHER, ADD],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    calls, _, finish = reassemble(chat(server, tools=[WEATHER, ADD], stream=True,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert finish == ["tool_calls"] and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_required_forces_a_call(tools_server):
    server, runner = tools_server
    runner.script = 'add", "arguments": {"a": 2}}'
    choice = chat(server, tools=[WEATHER, ADD], tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "add"


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_call_cut_by_max_tokens_is_the_same_whole_or_streamed(tools_server, tool_choice):
    """A call begun and cut off by max_tokens: the answer has the call as far as it got, finish "length", as its
    stream sends it."""
    server, runner = tools_server
    runner.script = CALL if tool_choice == "auto" else CALL[len('{"name": "'):]  # required: the opening is given
    args = {"tools": [WEATHER, ADD], "tool_choice": tool_choice, "max_tokens": 30}
    choice = server.client().chat.completions.create(model=MODEL, messages=USER, **args).choices[0]
    calls, content, finish = reassemble(server.client().chat.completions.create(
        model=MODEL, messages=USER, stream=True, **args))
    assert choice.finish_reason == "length" and finish == ["length"]
    assert (choice.message.content or "") == content
    (call,) = choice.message.tool_calls
    assert [(call.function.name, call.function.arguments)] == [(c["name"], c["arguments"]) for c in calls.values()]
    arguments = CALL[CALL.index('{"city"'):-1]
    assert call.function.name == "get_weather"
    assert 0 < len(call.function.arguments) < len(arguments) and arguments.startswith(call.function.arguments)


@pytest.mark.parametrize("cut_after", ['get_weather"', 'get_weather", "arguments"'])
def test_a_required_call_cut_before_its_arguments_is_a_call_whole_or_streamed(tools_server, cut_after):
    """Cut by max_tokens once the function's name is whole but before its arguments begin: the call with no
    arguments yet, not the call's JSON as content."""
    server, runner = tools_server
    runner.script = cut_after
    args = {"tools": [WEATHER, ADD], "tool_choice": "required"}
    tokens = len(server.engine.tokenizer.encode(cut_after, add_special_tokens=False))
    choice = server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=tokens, **args).choices[0]
    calls, content, finish = reassemble(server.client().chat.completions.create(
        model=MODEL, messages=USER, stream=True, max_tokens=tokens, **args))
    assert choice.finish_reason == "length" and finish == ["length"] and not choice.message.content and not content
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", "")]


def test_malformed_forced_call_falls_back_to_content(tools_server):
    server, runner = tools_server
    runner.script = "sorry, no JSON here"
    choice = chat(server, tools=[WEATHER], tool_choice={"type": "function",
                                                         "function": {"name": "get_weather"}}).choices[0]
    assert choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    assert choice.message.content == '{"name": "get_weather", "arguments": sorry, no JSON here'


def test_tools_reach_the_prompt(tools_server):
    server, _ = tools_server
    body = {"messages": USER, "tools": [WEATHER]}
    with_tools = HTTP.post(f"{server.base_url}/tokenize", json=body, headers=server.headers).json()
    without = HTTP.post(f"{server.base_url}/tokenize", json={"messages": USER}, headers=server.headers).json()
    assert with_tools["count"] > without["count"] + 20
    text = HTTP.post(f"{server.base_url}/detokenize", json={"tokens": with_tools["tokens"]},
                     headers=server.headers).json()["prompt"]
    assert "get_weather" in text and '"arguments"' in text


def test_tool_history_renders(tools_server):
    server, runner = tools_server
    runner.script = "It is 21 C."
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    response = server.client().chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert response.choices[0].message.content == "It is 21 C."


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].type"),
])
def test_bad_tool_requests(tools_server, body, param):
    server, _ = tools_server
    response = HTTP.post(f"{server.base_url}/v1/chat/completions", json={"messages": USER, **body},
                         headers=server.headers)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_model_without_chat_template_is_a_400(tools_server):
    server, _ = tools_server
    tokenizer = server.engine.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        response = HTTP.post(f"{server.base_url}/v1/chat/completions", json={"messages": USER},
                             headers=server.headers)
    finally:
        tokenizer.chat_template = template
    assert response.status_code == 400
    assert "no chat template" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages"


HERMES_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {% for t in tools %}{{ t | tojson }}{% endfor %}. Call one as "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
HERMES_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')


@pytest.fixture(scope="module")
def hermes_server(tiny_model_dir, tmp_path_factory):
    """The scripted server over a copy of the tiny model whose chat template teaches `<tool_call>` blocks."""
    import shutil

    from conftest import start_scripted

    path = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_model_dir, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_file.write_text(json.dumps(config))
    server, runner = start_scripted(str(path))
    runner.script = HERMES_ANSWER
    yield server
    server.stop()


def test_hermes_tool_calls_after_content(hermes_server):
    choice = chat(hermes_server, tools=[WEATHER, ADD]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    calls_streamed, content, finish = reassemble(chat(hermes_server, tools=[WEATHER, ADD], stream=True))
    assert content == "Let me check." and finish == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls_streamed.values()] == calls


def test_the_tool_call_parser_flag_sets_the_format_calls_are_forced_taught_and_read_in(start_scripted_server):
    """`--tool-call-parser hermes` over a template that does not render tools (the tiny model's): the instruction
    teaches `<tool_call>` blocks, a forced call opens one, and the hermes parser reads it (and /tokenize renders
    the same prompt)."""
    server, runner = start_scripted_server(tool_call_parser="hermes")
    runner.script = 'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    choice = chat(server, tools=[WEATHER], tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    calls, content, finish = reassemble(chat(server, tools=[WEATHER], tool_choice="required", stream=True))
    assert finish == ["tool_calls"] and not content and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    runner.script = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    auto = chat(server, tools=[WEATHER]).choices[0]
    assert auto.finish_reason == "tool_calls" and auto.message.content == "Checking."
    tokens = HTTP.post(f"{server.base_url}/tokenize", json={"messages": USER, "tools": [WEATHER]},
                       headers=server.headers).json()["tokens"]
    prompt = HTTP.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, headers=server.headers).json()
    assert "<tool_call>" in prompt["prompt"]


def test_a_function_without_parameters_is_forced_with_empty_arguments(tools_server):
    """OpenAI's function without `parameters` takes none: a forced call's arguments are {}."""
    server, runner = tools_server
    runner.script = "{}}"
    choice = chat(server, tools=[{"type": "function", "function": {"name": "ping"}}],
                  tool_choice={"type": "function", "function": {"name": "ping"}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0].function
    assert call.name == "ping" and call.arguments == "{}"


@pytest.mark.parametrize("exclude", [False, True])
def test_tool_choice_none_renders_the_tools_unless_the_server_excludes_them(start_scripted_server, exclude):
    """vLLM's default keeps a request's tools in a template that renders them under tool_choice "none";
    --exclude-tools-when-tool-choice-none leaves them out. No call is parsed either way."""
    server, runner = start_scripted_server(trust_request_chat_template=True,
                                           exclude_tools_when_tool_choice_none=exclude)
    runner.script = CALL
    reply = HTTP.post(f"{server.base_url}/v1/chat/completions", headers=server.headers, timeout=30, json={
        "model": MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 64,
        "chat_template": HERMES_TEMPLATE, "return_token_ids": True}).json()
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["choices"][0]["message"]["content"] == CALL
    prompt = HTTP.post(f"{server.base_url}/detokenize", json={"tokens": reply["prompt_token_ids"]},
                       headers=server.headers).json()["prompt"]
    assert ("Tools:" in prompt and "get_weather" in prompt) is not exclude
