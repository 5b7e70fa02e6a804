"""--reasoning-parser end to end: the real server and engine with a scripted model that answers a fixed text; the
thinking comes as `reasoning` (and `reasoning_content`) apart from the content, whole and streamed, in chat and
in the Responses API, through the official `openai` client."""

import json
import shutil
from pathlib import Path

import pytest
import transformers
from conftest import MODEL, start_scripted
from http_client import HTTP

THOUGHT = "The user greets me; 2 < 3, so I answer kindly."
ANSWER = f"<think>{THOUGHT}</think>Hello! How can I help?"
USER = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reasoning_server(tiny_model_dir):
    server, runner = start_scripted(tiny_model_dir, reasoning_parser="qwen3")
    runner.step_delay_s = 0.0
    runner.script = ANSWER
    yield server, runner
    server.stop()


def chat(server, **kwargs):
    return server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=200, **kwargs)


def streamed(server, **kwargs) -> tuple[str, str, list[str]]:
    reasoning, content, finish = "", "", []
    for chunk in chat(server, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            finish += [choice.finish_reason] if choice.finish_reason else []
    return reasoning, content, finish


def test_the_thinking_comes_apart_from_the_content_whole_and_streamed(reasoning_server, hf_tokenizer):
    server, _ = reasoning_server
    response = chat(server)
    message = response.choices[0].message
    assert message.content == "Hello! How can I help?"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == THOUGHT
    # Its reasoning tokens: those of the answer up to the end of the thinking.
    thinking = len(hf_tokenizer.encode(ANSWER[:ANSWER.index("</think>") + len("</think>")], add_special_tokens=False))
    assert response.usage.completion_tokens_details.reasoning_tokens == thinking
    assert streamed(server) == (THOUGHT, "Hello! How can I help?", ["stop"])
    usage = [c.usage for c in chat(server, stream=True, stream_options={"include_usage": True}) if c.usage][-1]
    assert usage.completion_tokens_details.reasoning_tokens == thinking


def test_include_reasoning_false_leaves_the_thinking_out(reasoning_server, scripted):
    server, _ = reasoning_server
    message = chat(server, extra_body={"include_reasoning": False}).choices[0].message
    assert message.content == "Hello! How can I help?" and (message.model_extra or {}).get("reasoning") is None
    assert streamed(server, extra_body={"include_reasoning": False}) == ("", "Hello! How can I help?", ["stop"])
    plain, runner = scripted  # a server without a reasoning parser tells no thinking apart: none to leave out
    runner.script = ANSWER
    try:
        reply = HTTP.post(f"{plain.base_url}/v1/chat/completions", headers=plain.headers,
                          json={"model": MODEL, "messages": USER, "include_reasoning": False, "max_tokens": 200})
    finally:
        runner.script = "Hello!"
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == ANSWER


def test_tool_calls_are_read_from_the_content_after_the_thinking(reasoning_server):
    server, runner = reasoning_server
    runner.script = '<think>I need the weather.</think>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    try:
        choice = chat(server, tools=[WEATHER]).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning"] == "I need the weather."
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    finally:
        runner.script = ANSWER


def test_a_replayed_answer_with_its_thinking_is_taken(reasoning_server):
    server, _ = reasoning_server
    first = chat(server).choices[0].message
    history = [*USER, first.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]
    assert "reasoning" in history[1]
    assert server.client().chat.completions.create(model=MODEL, messages=history, max_tokens=8).choices
    both = {**history[1], "reasoning_content": "something else"}
    reply = HTTP.post(f"{server.base_url}/v1/chat/completions", headers=server.headers,
                      json={"model": MODEL, "messages": [*USER, both]})
    assert reply.status_code == 400 and "reasoning_content" in reply.json()["error"]["message"]


def test_responses_carry_a_reasoning_item_whole_and_streamed(reasoning_server):
    server, _ = reasoning_server
    client = server.client()
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=200)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT and whole.output_text == "Hello! How can I help?"
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == whole.output_text
    # The client's replay of its output (the reasoning item first) continues the conversation.
    replay = [{"role": "user", "content": "Hi"}, *[item.model_dump(exclude_none=True) for item in whole.output],
              {"role": "user", "content": "And then?"}]
    again = client.responses.create(model=MODEL, input=replay, max_output_tokens=8)  # cut inside its thinking
    assert again.status == "incomplete" and [item.type for item in again.output] == ["reasoning"]


def test_responses_cut_while_thinking_hold_only_the_incomplete_reasoning(reasoning_server):
    server, _ = reasoning_server
    client = server.client()
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=12)
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=12) as stream:
        list(stream)
        final = stream.get_final_response()
    for response in (whole, final):
        assert response.status == "incomplete"
        assert [(item.type, item.status) for item in response.output] == [("reasoning", "incomplete")]
    assert whole.output[0].content[0].text == final.output[0].content[0].text
    effort = client.responses.create(model=MODEL, input="Hi", max_output_tokens=12, reasoning={"effort": "low"})
    assert effort.status == "incomplete"  # taken (the template decides what effort means)
    # Its replay (a thinking with no answer after it) goes on: that thinking is an assistant turn of its own.
    replay = [{"role": "user", "content": "Hi"}, *[item.model_dump(exclude_none=True) for item in whole.output],
              {"role": "user", "content": "And then?"}]
    again = client.responses.create(model=MODEL, input=replay, max_output_tokens=200)
    assert again.status == "completed" and again.output_text == "Hello! How can I help?"
    ends_thinking = client.responses.create(model=MODEL, input=replay[:2], max_output_tokens=200)
    assert ends_thinking.output_text == "Hello! How can I help?"


def test_thinking_sent_back_reaches_the_template(tiny_model_dir):
    """An earlier answer's thinking, as a chat message's reasoning or a Responses reasoning item, is the template's
    reasoning_content."""
    server, _ = start_scripted(tiny_model_dir, reasoning_parser="qwen3", trust_request_chat_template=True)
    template = ("{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                "</think>{% endif %}{{ m.content }}{% endfor %}[assistant]")
    history = [*USER, {"role": "assistant", "content": "Hello", "reasoning": "be kind"},
               {"role": "user", "content": "again"}]
    try:
        reply = HTTP.post(f"{server.base_url}/v1/chat/completions", headers=server.headers,
                          json={"model": MODEL, "messages": history, "chat_template": template, "max_tokens": 1,
                                "return_token_ids": True}).json()
        prompt = server.engine.tokenizer.decode(reply["prompt_token_ids"])
        assert "[assistant]<think>be kind</think>Hello[user]again" in prompt
    finally:
        server.stop()


def test_a_grammar_shaped_answer_skips_the_thinking_the_template_opens(tiny_model_dir):
    """With a reasoning parser, a forced tool call comes after the template's open <think> is closed, as the
    template would with thinking off, and so does a structured answer where the tags are not single tokens (this
    tokenizer's); others think as the template says (a structured answer too where it can: see below)."""
    server, _ = start_scripted(tiny_model_dir, reasoning_parser="qwen3", trust_request_chat_template=True)
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]<think>"
    body = {"model": MODEL, "messages": USER, "chat_template": template, "max_tokens": 1, "return_token_ids": True}

    def prompt(**fields) -> str:
        reply = HTTP.post(f"{server.base_url}/v1/chat/completions", headers=server.headers, json={**body, **fields})
        assert reply.status_code == 200, reply.text
        return server.engine.tokenizer.decode(reply.json()["prompt_token_ids"])

    try:
        assert prompt().endswith("[assistant]<think>")
        assert "[assistant]<think></think>\n\n" in prompt(tools=[WEATHER], tool_choice="required")
        # (structured outputs over this tokenizer take the same rule; this scripted engine has no grammar backend)
        from kestrel.entrypoints.chat import render_chat

        rendered = render_chat(server.engine.tokenizer, USER, chat_template=template, close_thinking=True)
        assert rendered.text.endswith("[assistant]<think></think>\n\n")
    finally:
        server.stop()


# ----- a structured answer thinks first ---------------------------------------------------------------------

CITY = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY_JSON = '{"city": "Paris"}'


def write_thinking_tokenizer_model(src: str, dst: Path) -> tuple[int, int]:
    """A copy of the checkpoint at `src` whose tokenizer has `<think>` and `</think>` as single tokens, as a
    reasoning model's has (two of its highest merged tokens, ones no merge builds on, give up their ids); their
    ids."""
    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    pieces = [m.split(" ") if isinstance(m, str) else m for m in merges]
    used = {piece for pair in pieces for piece in pair}
    by_id = {i: token for token, i in vocab.items()}
    ids = sorted(i for i in sorted(by_id, reverse=True) if by_id[i] not in used)[-2:]
    for token_id, tag in zip(ids, ("<think>", "</think>")):
        old = by_id[token_id]
        del vocab[old]
        vocab[tag] = token_id
        spec["model"]["merges"] = merges = [m for m, pair in zip(merges, pieces) if "".join(pair) != old]
        pieces = [m.split(" ") if isinstance(m, str) else m for m in merges]
        spec["added_tokens"].append({"id": token_id, "content": tag, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return ids[0], ids[1]


@pytest.fixture(scope="module")
def thinking_server(tiny_model_dir, tmp_path_factory):
    """A qwen3-parser server over a tokenizer with single-token think tags and the real grammar backend (the
    scripted runner records each step's mask)."""
    model_dir = tmp_path_factory.mktemp("thinking") / "model"
    tags = write_thinking_tokenizer_model(tiny_model_dir, model_dir)
    server, runner = start_scripted(str(model_dir), reasoning_parser="qwen3", trust_request_chat_template=True,
                                    grammars=True)
    yield server, runner, tags
    server.stop()


def allowed(mask, token_id: int) -> bool:
    return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)


def constrained_chat(server, runner, script: str, **body):
    """A chat with a JSON schema answered by `script` (then EOS): the message, and per sampled step its token and
    its mask row (None: sampled without one)."""
    runner.script, runner.masks = script, []
    reply = HTTP.post(f"{server.base_url}/v1/chat/completions", headers=server.headers,
                      json={"model": MODEL, "messages": USER, "max_tokens": 100, "response_format": CITY, **body})
    assert reply.status_code == 200, reply.text
    tokenizer = server.engine.tokenizer
    tokens = tokenizer.encode(script, add_special_tokens=False) + [tokenizer.eos_token_id]
    rows = [mask[1][0] if mask is not None and mask[0] else None for mask in runner.masks]
    return reply.json()["choices"][0], list(zip(tokens, rows))


def test_a_structured_answer_thinks_first_and_its_grammar_follows(thinking_server):
    """qwen3: the answer may open its thinking with its first token (the grammar's first mask allows the tag);
    inside it nothing is masked, and from the token after `</think>` every token is the grammar's."""
    server, runner, (start, end) = thinking_server
    choice, steps = constrained_chat(server, runner, f"<think>Paris, surely.</think>{CITY_JSON}")
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == CITY_JSON and choice["message"]["reasoning"] == "Paris, surely."
    first_token, first_row = steps[0]
    assert first_token == start and allowed(first_row, start) and not allowed(first_row, end)
    closing = [token for token, _ in steps].index(end)
    assert all(row is None for _, row in steps[1:closing + 1])  # the thinking, its end tag included
    assert all(row is not None and allowed(row, token) for token, row in steps[closing + 1:])
    # Streamed alike.
    runner.masks = []
    assert streamed(server, response_format=CITY) == ("Paris, surely.", CITY_JSON, ["stop"])


def test_an_answer_that_does_not_think_is_the_grammars_from_its_first_token(thinking_server):
    server, runner, (start, _) = thinking_server
    choice, steps = constrained_chat(server, runner, CITY_JSON)
    assert choice["message"]["content"] == CITY_JSON and choice["message"].get("reasoning") is None
    assert allowed(steps[0][1], start)  # it could have thought
    assert all(row is not None and allowed(row, token) for token, row in steps)


def test_the_template_decides_where_the_answer_starts(thinking_server):
    """A template that opens the thinking: the answer starts inside it, unmasked. One that closes it (thinking
    off): the grammar applies from the first token, and the start tag is not allowed."""
    server, runner, (start, end) = thinking_server
    opened = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]<think>"
    choice, steps = constrained_chat(server, runner, f"Paris.</think>{CITY_JSON}", chat_template=opened)
    assert choice["message"]["content"] == CITY_JSON and choice["message"]["reasoning"] == "Paris."
    closing = [token for token, _ in steps].index(end)
    assert all(row is None for _, row in steps[:closing + 1])
    assert all(row is not None and allowed(row, token) for token, row in steps[closing + 1:])
    closed = opened + "\n\n</think>\n\n"
    choice, steps = constrained_chat(server, runner, CITY_JSON, chat_template=closed)
    assert choice["message"]["content"] == CITY_JSON and choice["message"].get("reasoning") is None
    assert not allowed(steps[0][1], start)
    assert all(row is not None and allowed(row, token) for token, row in steps)


def test_a_think_tag_the_user_mentions_opens_nothing(thinking_server):
    """Only the answer's part of the prompt (after the last message it does not continue) says whether it starts
    inside a thinking: a user's or system's `<think>` is text."""
    server, runner, (start, _) = thinking_server
    messages = [{"role": "system", "content": "Think in <think> tags."},
                {"role": "user", "content": "What does the <think> tag do?"}]
    choice, steps = constrained_chat(server, runner, CITY_JSON, messages=messages)
    assert choice["message"]["content"] == CITY_JSON and choice["message"].get("reasoning") is None
    assert allowed(steps[0][1], start)  # masked from the first token, which may open a thinking
    runner.script = "Hello!"
    plain = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    assert plain.choices[0].message.content == "Hello!" and not (plain.choices[0].message.model_extra or {}).get(
        "reasoning")


def test_deepseek_r1_after_a_closed_thinking_is_all_content(tiny_model_dir):
    server, runner = start_scripted(tiny_model_dir, reasoning_parser="deepseek_r1", trust_request_chat_template=True)
    closed = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]<think>\n\n</think>\n\n"
    runner.script = "Paris."
    try:
        message = server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=20,
                                                          extra_body={"chat_template": closed}).choices[0].message
        assert message.content == "Paris." and not (message.model_extra or {}).get("reasoning")
        opened = server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=20).choices[0].message
        # R1 thinks without the tag; an answer that is all thinking has no content (null, as vLLM's parsers say)
        assert opened.content is None and opened.model_extra["reasoning"] == "Paris."
    finally:
        server.stop()


def test_beam_search_answers_are_split_too(tiny_model_dir):
    """Beam search's answers carry their thinking apart as sampled ones do (deepseek_r1: a real model's answer
    without `</think>` is all thinking), with the reasoning tokens in the usage."""
    from conftest import MAX_MODEL_LEN, LiveServer

    from kestrel.entrypoints.async_engine import AsyncEngine
    from kestrel.entrypoints.server import build_app

    engine = AsyncEngine.from_args(tiny_model_dir, max_model_len=MAX_MODEL_LEN, device="cpu",
                                   dtype="float32").start()
    server = LiveServer(build_app(engine, MODEL, reasoning_parser="deepseek_r1"), engine, None)
    try:
        reply = server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=6, n=2,
                                                        extra_body={"use_beam_search": True})
        for choice in reply.choices:
            assert choice.message.content is None and choice.message.model_extra["reasoning"]
        assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens
    finally:
        server.stop()
