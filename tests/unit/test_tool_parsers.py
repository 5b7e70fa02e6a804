"""Tool-call formats other than Llama 3.x JSON: Hermes/Qwen2 `<tool_call>` blocks and Mistral `[TOOL_CALLS]`,
parsed whole and streamed in pieces of every size."""

from __future__ import annotations

import json

import pytest

from kestrel.entrypoints.chat import (
    ContentDelta,
    ToolArgumentsDelta,
    ToolCallStart,
    forced_prefix,
    make_tool_parser,
    parse_tool_calls,
    render_chat,
    tool_format,
)

NAMES = {"get_weather", "add"}
HERMES_TWO = ('I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, "}"]}}\n</tool_call>')
MISTRAL_TWO = ('Sure.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, '
               '{"name": "get_weather", "arguments": {"city": "Rome"}}]')


def streamed(fmt: str, text: str, piece: int, prefix: str = "") -> tuple[str, list[tuple[str, dict]]]:
    """Feed `text` in pieces of `piece` characters; the reassembled content and calls."""
    parser = make_tool_parser(fmt, NAMES, prefix)
    events = []
    for i in range(0, len(text), piece):
        events += parser.feed(text[i: i + piece])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolArgumentsDelta):
            calls[e.index][1] += e.text
    return content, [(name, json.loads(args)) for name, args in calls.values()]


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 11, 10_000])
def test_hermes_blocks_after_content(piece: int) -> None:
    content, calls = streamed("hermes", HERMES_TWO, piece)
    assert content == "I will look that up."
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, "}"]})]


@pytest.mark.parametrize("piece", [1, 4, 7, 10_000])
def test_mistral_array_after_content(piece: int) -> None:
    content, calls = streamed("mistral", MISTRAL_TWO, piece)
    assert content == "Sure."
    assert calls == [("add", {"a": 1}), ("get_weather", {"city": "Rome"})]


def test_whole_output_parsing() -> None:
    result = parse_tool_calls(HERMES_TWO, NAMES, fmt="hermes")
    assert result.content == "I will look that up." and [c.name for c in result.calls] == ["get_weather", "add"]
    assert all(c.valid for c in result.calls)
    only_call = parse_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>', NAMES, fmt="hermes")
    assert only_call.content is None and len(only_call.calls) == 1


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "Just an answer with a < sign and <tool"),  # a partial marker at the end is content after all
    ("hermes", "no calls at all"),
    ("mistral", "An answer [TOOL"),
])
def test_text_without_calls_stays_content(fmt: str, text: str) -> None:
    assert streamed(fmt, text, 1) == (text, [])
    result = parse_tool_calls(text, NAMES, fmt=fmt)
    assert result.content == text and result.calls == []


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
    "<tool_call>not json</tool_call>",
])
def test_bad_calls_fall_back_to_content(text: str) -> None:
    result = parse_tool_calls(text, NAMES, fmt="hermes")
    assert result.calls == [] and result.content == text


def test_forced_prefixes_and_format_detection() -> None:
    prefix = forced_prefix("named", "add", "hermes")
    assert prefix == '<tool_call>\n{"name": "add", "arguments": '
    result = parse_tool_calls('{"a": 2}}\n</tool_call>', NAMES, prefix=prefix, fmt="hermes")
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [("add", {"a": 2})]
    assert forced_prefix("required", None, "mistral") == '[TOOL_CALLS] [{"name": "'
    assert forced_prefix("auto", None, "hermes") == ""
    assert tool_format("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tool_format({"default": "[TOOL_CALLS]{{ tools }}"}) == "mistral"
    assert tool_format("{{ tools }}") == "llama3_json"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        make_tool_parser("xml", NAMES)


class _TemplateTokenizer:
    """Renders with jinja the way HF tokenizers do, enough for render_chat."""

    chat_template = ("{% if tools %}<tools>{{ tools | tojson }}</tools> Call with <tool_call>{json}</tool_call>"
                     "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}")

    def apply_chat_template(self, conversation, tools=None, chat_template=None, add_generation_prompt=True,
                            tokenize=False):
        import jinja2

        env = jinja2.Environment()
        env.filters["tojson"] = json.dumps
        return env.from_string(chat_template).render(messages=conversation, tools=tools,
                                                     add_generation_prompt=add_generation_prompt)


def test_render_chat_picks_the_template_format() -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "1+1?"}]
    prompt = render_chat(_TemplateTokenizer(), messages, tools=[tool], tool_choice="required")
    assert prompt.tool_format == "hermes"
    assert prompt.text.endswith('<|assistant|><tool_call>\n{"name": "')
    assert prompt.assistant_prefix == '<tool_call>\n{"name": "'
    plain = render_chat(_TemplateTokenizer(), messages)
    assert plain.tool_format == "llama3_json" and plain.assistant_prefix == ""


def test_tool_choice_none_keeps_the_tools_in_a_template_that_renders_them() -> None:
    """vLLM's default: with tool_choice "none" the template still renders the tools (nothing opens or teaches a
    call); --exclude-tools-when-tool-choice-none leaves them out. A template without tools gets no instruction."""
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "1+1?"}]
    kept = render_chat(_TemplateTokenizer(), messages, tools=[tool], tool_choice="none")
    assert '<tools>[{"type": "function"' in kept.text and kept.assistant_prefix == ""
    assert kept.text.endswith("<|assistant|>")
    left_out = render_chat(_TemplateTokenizer(), messages, tools=[tool], tool_choice="none",
                           exclude_tools_when_none=True)
    assert left_out.text == render_chat(_TemplateTokenizer(), messages).text

    class Plain(_TemplateTokenizer):
        chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"

    assert render_chat(Plain(), messages, tools=[tool], tool_choice="none").text == "<|user|>1+1?<|assistant|>"


def test_earlier_calls_reach_a_tool_template_as_its_own_whether_or_not_the_request_sends_tools() -> None:
    """The turn after a tool result often comes without `tools`: the assistant's earlier call still reaches a
    template that renders tools as its `tool_calls` (as transformers hands them over), so the history renders the
    same either way; a template without tools gets the call as JSON text in the content."""
    class Native(_TemplateTokenizer):
        chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}"
                         "CALL {{ c.function.name }}{% endfor %}{% endfor %}{% if tools %}{% endif %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")

    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    with_tools = render_chat(Native(), messages, tools=[tool]).text
    without = render_chat(Native(), messages).text
    assert "<|assistant|>CALL add" in with_tools and with_tools == without

    class Plain(_TemplateTokenizer):
        chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"

    assert '<|assistant|>{"name": "add", "arguments": {"a": 1}}' in render_chat(Plain(), messages).text


@pytest.mark.parametrize("function", [{"name": "ping"}, {"name": "ping", "parameters": {}}])
def test_a_function_without_parameters_is_called_with_no_arguments(function: dict) -> None:
    """OpenAI's function without parameters takes none: a forced call's arguments are {} (an object schema without
    properties would let any object through)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kestrel.structured.tool_grammar import tool_call_grammar

    tools = [{"type": "function", "function": function}]
    named = tool_call_grammar(tools, "named", "ping", "llama3_json")
    assert accepts(named, "{}}") and not accepts(named, '{"a": 1}}')
    required = tool_call_grammar(tools, "required", None, "hermes")
    assert accepts(required, 'ping", "arguments": {}}\n</tool_call>')
    assert not accepts(required, 'ping", "arguments": {"x": "y"}}\n</tool_call>')
    open_object = [{"type": "function", "function": {"name": "any", "parameters": {"type": "object"}}}]
    assert accepts(tool_call_grammar(open_object, "named", "any", "llama3_json"), '{"a": 1}}')  # as written


@pytest.mark.parametrize("answer", ['get_weat', 'zzz", "arguments": {}}', 'get_weather", "arguments": {"city": "x"}}'])
def test_a_marked_call_that_fails_reads_the_same_streamed_and_whole(answer: str) -> None:
    """A forced hermes call (its opening in the prompt) that stops before its name is whole, or names no tool: the
    streamed content is the whole output's, the opening marker included."""
    prefix = forced_prefix("required", None, "hermes")
    whole = parse_tool_calls(answer, ["get_weather"], prefix, "hermes", cut=True)
    parser = make_tool_parser("hermes", ["get_weather"], prefix)
    events = [e for piece in (answer[:4], answer[4:]) for e in parser.feed(piece)] + parser.finish(cut=True)
    streamed = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert (whole.content or "") == streamed and [c.name for c in whole.calls] == [c.name for c in parser.calls]


def test_auto_content_format_hands_parts_to_a_template_that_loops_over_content() -> None:
    """vLLM's chat_template_content_format: "auto" passes a message's content as parts where the template loops
    over it (else it would render nothing), "string" as text, "openai" always as parts; a bad value is refused."""
    from kestrel.entrypoints.chat import reads_content_parts
    from kestrel.request import InvalidRequestError

    class Looping(_TemplateTokenizer):
        chat_template = ("{% for m in messages %}<|{{ m.role }}|>{% for p in m['content'] %}"
                         "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")

    messages = [{"role": "user", "content": "hello world"}]
    assert render_chat(Looping(), messages).text == "<|user|>hello world<|assistant|>"
    assert render_chat(Looping(), messages, content_format="string").text == "<|user|><|assistant|>"
    plain = _TemplateTokenizer()
    assert not reads_content_parts(plain.chat_template) and reads_content_parts(Looping.chat_template)
    assert render_chat(plain, messages).text == "<|user|>hello world<|assistant|>"
    with pytest.raises(InvalidRequestError, match="chat_template_content_format"):
        render_chat(plain, messages, content_format="text")
