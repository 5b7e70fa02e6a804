"""Chat templates and tool calls: messages (+ tools) -> prompt, model text -> OpenAI `tool_calls`.

Tool calls are JSON objects `{"name": ..., "arguments": {...}}` ("parameters" is accepted too), in one of
three wrappings, chosen from the chat template: Llama 3.x's bare JSON (the answer is only the call, several
calls as a JSON array or one object after another), Hermes/Qwen2's `<tool_call>{...}</tool_call>` blocks
(after optional content), and Mistral's `[TOOL_CALLS] [{...}, ...]` (after optional content). A template that
does not render `tools` itself gets a system instruction describing the tools and the Llama 3.x format.
`tool_choice` "required" and a named function start the assistant turn with the call's opening (its marker,
then `{"name": "` or the whole header up to the arguments), so the model only has to continue it; there is no
guided decoding, so a model can still produce malformed JSON, and then the reply carries it as plain content
and the finish reason is not "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from kestrel.entrypoints.reasoning import THINK_END, answer_prompt, opened_by_prompt
from kestrel.request import InvalidRequestError

_WS = " \t\r\n"

TOOL_INSTRUCTION = "You can call these functions:\n{functions}\n\n{how}"
# How a call is written, per tool-call format (TOOL_FORMATS): what the instruction teaches a model whose template
# does not render tools, and what the parser of that format then reads.
_CALL = '{"name": <function name>, "arguments": <object of argument values>}'
HOW_TO_CALL = {
    "llama3_json": f"To call a function, answer with only a JSON object of the form {_CALL}; for several calls, a "
                   "JSON array of such objects. Do not add any other text to a function call.",
    "hermes": f"To call a function, answer with <tool_call>\n{_CALL}\n</tool_call>, one such block per call. Do "
              "not add any other text inside a block.",
    "mistral": f"To call functions, answer with [TOOL_CALLS] followed by a JSON array of objects of the form "
               f"{_CALL}. Do not add any other text to the calls.",
}
REQUIRED_INSTRUCTION = "\nYou must call at least one of the functions."
NAMED_INSTRUCTION = "\nYou must call the function {name}."


# ----- templates ------------------------------------------------------------------------------------

def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                        content_parts: bool = False) -> list[int]:
    text = render_chat(tokenizer, messages, tools=tools, tool_choice="auto" if tools else "none",
                       add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                       content_parts=content_parts).text
    return tokenizer.encode(text, add_special_tokens=False)


# How a model writes tool calls; also the choices of `kestrel serve --tool-call-parser`.
TOOL_FORMATS = ("llama3_json", "hermes", "mistral")
# (opening marker, closing marker) of the wrapped formats
_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]", None)}


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered conversation, ending with the assistant prefix
    assistant_prefix: str  # what the assistant turn was started with (a forced tool-call opening) or ""
    tool_format: str = "llama3_json"  # how the model writes tool calls (TOOL_FORMATS)
    answer_start: int = 0  # where the answer's own part of `text` starts (reasoning.answer_prompt)

    @property
    def answer_text(self) -> str:
        """The prompt's part that the answer's thinking reads: from `answer_start` on."""
        return self.text[self.answer_start:]


def check_final_message_continued(continue_final_message: bool | None, add_generation_prompt: bool | None,
                                  last_role: str | None) -> None:
    """continue_final_message goes on with the assistant's last message (`last_role`: the conversation's last
    message's role): it needs that message, and no generation prompt after it."""
    if not continue_final_message:
        return
    if add_generation_prompt is not False:
        raise InvalidRequestError("continue_final_message", "continue_final_message continues the last message, "
                                  "so it needs add_generation_prompt set to false")
    if last_role != "assistant":
        raise InvalidRequestError("continue_final_message", "continue_final_message needs the last message to be "
                                  "the assistant's")


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                tool_choice: str = "auto", named_tool: str | None = None, add_generation_prompt: bool = True,
                chat_template: str | None = None, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None, content_parts: bool = False,
                close_thinking: bool = False, tool_parser: str | None = None,
                exclude_tools_when_none: bool = False, content_format: str = "auto") -> ChatPrompt:
    """Render messages through the tokenizer's template. `tool_choice`: none, auto, required or named;
    `continue_final_message`: leave the last (assistant) message open for the model to go on with;
    `template_kwargs`: more variables for the template (e.g. enable_thinking); `content_parts`: hand each
    message's content to the template as a list of parts (`{"type": "text", "text": ...}`, `{"type": "image"}`,
    `{"type": "audio"}`), as multimodal processors' templates read it, instead of one string; `close_thinking`: a
    grammar shapes the whole answer (--reasoning-parser servers), so a thinking the prompt leaves open is closed
    before it, as a reasoning model's template does with its thinking turned off. `tool_parser`: the tool-call
    format the server was told the model writes (--tool-call-parser), over the one the template shows; the forced
    call's opening, the instruction a template without tools gets and the prompt's `tool_format` all follow it.
    With tool_choice "none" a template that renders tools still gets them (vLLM's default), unless
    `exclude_tools_when_none`; nothing else teaches or opens a call then. `content_format` (vLLM's
    chat_template_content_format): "openai" hands every message's content over as parts, "string" as text (unless
    `content_parts`), "auto" as parts where the template loops over a message's content (`reads_content_parts`)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("messages", "this model's tokenizer has no chat template; use a completion "
                                  "prompt (/v1/completions) instead, or pass chat_template")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InvalidRequestError("messages", "messages must be a list of {'role': ..., 'content': ...} dicts")
    if content_format not in CONTENT_FORMATS:
        raise InvalidRequestError("chat_template_content_format", f"chat_template_content_format must be one of "
                                  f"{list(CONTENT_FORMATS)}, got {content_format!r}")
    content_parts = content_parts or content_format == "openai" or (content_format == "auto"
                                                                     and reads_content_parts(template))
    taken = sorted(set(template_kwargs or ()) & _OWN_TEMPLATE_VARIABLES)
    if taken:
        raise InvalidRequestError("chat_template_kwargs", f"chat_template_kwargs may not set {taken}: the request's "
                                  "own fields set them (messages, tools, add_generation_prompt, "
                                  "continue_final_message, chat_template); send them there")
    use_tools = bool(tools) and tool_choice != "none"
    renders_tools = template_renders_tools(template)
    native = bool(tools) and (use_tools or not exclude_tools_when_none) and renders_tools
    fmt = tool_parser or (tool_format(template) if native else "llama3_json")
    # Earlier turns' calls go to a template that renders tools as its own tool_calls whether or not this request
    # sends tools (a follow-up after a tool result often does not): one history, one prompt.
    conversation = [_normalize_message(m, renders_tools, content_parts) for m in messages]
    if use_tools and not native:
        conversation = _with_tool_instruction(conversation, tools or [], tool_choice, named_tool, fmt)
    try:
        extra = {**(template_kwargs or {}), **({"continue_final_message": True} if continue_final_message else {})}
        text = tokenizer.apply_chat_template(conversation, tools=tools if native else None, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    except Exception as e:  # a template raises whatever its author chose (jinja errors, ValueError, ...)
        raise InvalidRequestError("messages", f"the chat template could not render these messages: {e}") from None
    answer_start = answer_prompt(text, messages)
    if close_thinking and opened_by_prompt(text[answer_start:]):
        text += f"{THINK_END}\n\n"
    prefix = forced_prefix(tool_choice, named_tool, fmt) if use_tools and add_generation_prompt else ""
    return ChatPrompt(text + prefix, prefix, fmt, answer_start)


# What render_chat hands the template itself, from the request's own fields.
_OWN_TEMPLATE_VARIABLES = frozenset({"messages", "conversation", "tools", "add_generation_prompt",
                                     "continue_final_message", "chat_template", "tokenize"})


def special_token_texts(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into special (control) tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {token.content for token in decoder.values() if getattr(token, "special", False)}
    texts.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted((t for t in texts if t), key=len, reverse=True)


def encode_chat(tokenizer: Any, text: str, message_texts: list[str], specials: Sequence[str]) -> list[int]:
    """Token ids of a rendered chat prompt in which the messages' own text never becomes a control token.

    The template's text is encoded as usual (its special tokens stay special); each message text that holds one of
    the `specials` strings (`special_token_texts`) is found in the rendered prompt, in order, and encoded with
    special tokens split into plain text, so a user cannot forge a turn with
    "<|end_of_text|><|start_header_id|>system...". A template that rewrites such a text beyond trimming is refused
    rather than guessed at. No `specials` is the permissive behaviour (the whole prompt encoded at once)."""
    risky = [m for m in message_texts if m and any(s in m for s in specials)]
    if not risky:
        return tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    position = 0
    for content in risky:
        at = text.find(content, position)
        if at < 0:
            content = content.strip()
            at = text.find(content, position)
        if at < 0:
            raise InvalidRequestError("messages", "a message holds special-token text that the chat template "
                                      "rewrites, so it cannot be kept as plain text; remove the special tokens "
                                      f"({', '.join(s for s in specials if s in content)[:200]})")
        ids += tokenizer.encode(text[position:at], add_special_tokens=False)
        ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        position = at + len(content)
    ids += tokenizer.encode(text[position:], add_special_tokens=False)
    return ids


CONTENT_FORMATS = ("auto", "string", "openai")
# A loop over a message's content (`for part in message['content']`, `for c in m.content`): the template reads the
# content as a list of parts, as OpenAI sends it.
_CONTENT_LOOP = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


def _sources(template: str | dict[str, str]) -> list[str]:
    """A template's Jinja sources: one, or each named template of a tokenizer that has several."""
    return list(template.values()) if isinstance(template, dict) else [template]


def reads_content_parts(template: str | dict[str, str]) -> bool:
    return any(_CONTENT_LOOP.search(source) for source in _sources(template))


def template_renders_tools(template: str | dict[str, str]) -> bool:
    return any("tools" in source for source in _sources(template))


def tool_format(template: str | dict[str, str]) -> str:
    """The tool-call format a template teaches its model, recognized by the markers it renders."""
    source = " ".join(_sources(template))
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    return "llama3_json"


def forced_prefix(tool_choice: str, named_tool: str | None, fmt: str = "llama3_json") -> str:
    if tool_choice == "named" and named_tool:
        call = '{"name": ' + json.dumps(named_tool) + ', "arguments": '
    elif tool_choice == "required":
        call = '{"name": "'
    else:
        return ""
    if fmt == "hermes":
        return "<tool_call>\n" + call
    if fmt == "mistral":
        return "[TOOL_CALLS] [" + call
    return call


def _normalize_message(message: dict[str, Any], native_tools: bool, content_parts: bool = False) -> dict[str, Any]:
    role = "system" if message["role"] == "developer" else message["role"]
    content = message.get("content")
    if content_parts:
        return _message_with_parts(message, role, native_tools)
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name"):
        out["name"] = message["name"]
    if message.get("reasoning_content") is not None:  # an earlier answer's thinking, for templates that render it
        out["reasoning_content"] = message["reasoning_content"]
    calls = message.get("tool_calls") or []
    if calls and native_tools:
        out["tool_calls"] = [_native_call(call) for call in calls]
    elif calls:
        rendered = [{"name": c["function"]["name"], "arguments": _loads_or_raw(c["function"].get("arguments", ""))}
                    for c in calls]
        text = json.dumps(rendered[0] if len(rendered) == 1 else rendered)
        out["content"] = f"{out['content']}\n{text}" if out["content"] else text
    return out


def _message_with_parts(message: dict[str, Any], role: str, native_tools: bool) -> dict[str, Any]:
    """A message whose content is a list of text, image and audio parts (a string becomes one text part)."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [{"type": p["type"]} if isinstance(p, dict) and p.get("type") in ("image", "audio")
                 else {"type": "text", "text": p.get("text", "") if isinstance(p, dict) else str(p)} for p in content]
    else:
        parts = [{"type": "text", "text": content}] if content else []
    text_only = _normalize_message({**message, "content": ""}, native_tools)
    if text_only["content"]:  # tool calls rendered as text
        parts.append({"type": "text", "text": text_only["content"]})
    return {**text_only, "role": role, "content": parts}


def _native_call(call: dict[str, Any]) -> dict[str, Any]:
    # HF templates expect the arguments as a mapping (they serialize it themselves).
    function = call["function"]
    native = {"type": "function",
              "function": {"name": function["name"], "arguments": _loads_or_raw(function.get("arguments", ""))}}
    if call.get("id"):
        native["id"] = call["id"]
    return native


def _loads_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _with_tool_instruction(conversation: list[dict[str, Any]], tools: list[dict[str, Any]], tool_choice: str,
                           named_tool: str | None, fmt: str) -> list[dict[str, Any]]:
    functions = "\n".join(json.dumps(tool.get("function", tool)) for tool in tools)
    instruction = TOOL_INSTRUCTION.format(functions=functions, how=HOW_TO_CALL[fmt])
    if tool_choice == "required":
        instruction += REQUIRED_INSTRUCTION
    elif tool_choice == "named" and named_tool:
        instruction += NAMED_INSTRUCTION.format(name=named_tool)
    if conversation and conversation[0]["role"] == "system":
        first = dict(conversation[0], content=f"{conversation[0]['content']}\n\n{instruction}")
        return [first, *conversation[1:]]
    return [{"role": "system", "content": instruction}, *conversation]


# ----- tool-call parsing ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgumentsDelta:
    index: int
    text: str


ParserEvent = ContentDelta | ToolCallStart | ToolArgumentsDelta


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    @property
    def valid(self) -> bool:
        if not self.complete:
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _JsonScanner:
    """Finds where a JSON value that starts with `{` or `[` ends, one chunk of text at a time."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self._started = depth > 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, start: int) -> int | None:
        """Consume text[start:]; return the index just past the value's end, or None if it goes on."""
        for i in range(start, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self.depth += 1
                self._started = True
            elif c in "}]":
                self.depth -= 1
                if self._started and self.depth == 0:
                    return i + 1
        return None


_PARTIAL = "partial"
_FAIL = "fail"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _literal(text: str, i: int, options: tuple[str, ...]) -> int | str:
    """Index past whichever option text[i:] starts with (after whitespace), _PARTIAL or _FAIL."""
    i = _skip_ws(text, i)
    rest = text[i:]
    if not rest:
        return _PARTIAL
    for option in options:
        if rest.startswith(option):
            return i + len(option)
    return _PARTIAL if any(option.startswith(rest) for option in options) else _FAIL


def _string(text: str, i: int) -> tuple[int, str] | str:
    """A JSON string starting at text[i] (after whitespace): (index past it, value), _PARTIAL or _FAIL."""
    i = _skip_ws(text, i)
    if i >= len(text):
        return _PARTIAL
    if text[i] != '"':
        return _FAIL
    j, escaped = i + 1, False
    while j < len(text):
        c = text[j]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            try:
                return j + 1, json.loads(text[i : j + 1])
            except ValueError:
                return _FAIL
        j += 1
    return _PARTIAL


def _match_name(text: str, start: int) -> tuple[int, str] | str:
    """`{"name": "<name>"`: (index after the name's string, name), or _PARTIAL / _FAIL."""
    i = _literal(text, start, ("{",))
    for expected in (('"name"',), (":",)):
        if isinstance(i, str):
            return i
        i = _literal(text, i, expected)
    return i if isinstance(i, str) else _string(text, i)


def _match_header(text: str, start: int) -> tuple[int, str] | str:
    """`{"name": "<name>", "arguments": ` up to the arguments' opening `{`: (index of that brace, name)."""
    name = _match_name(text, start)
    if isinstance(name, str):
        return name
    i, value = name
    for expected in ((",",), ('"arguments"', '"parameters"'), (":",)):
        i = _literal(text, i, expected)
        if isinstance(i, str):
            return i
    i = _skip_ws(text, i)
    if i >= len(text):
        return _PARTIAL
    return (i, value) if text[i] == "{" else _FAIL


def _header_name(text: str, start: int) -> str | None:
    """The function name of a call header cut short after its name string: `{"name": "<name>"` (and anything of
    the rest); None where the name itself is not whole."""
    name = _match_name(text, start)
    return None if isinstance(name, str) else name[1]


@dataclass
class ToolCallParser:
    """Turns streamed model text into content or tool-call events; `finish()` flushes the rest.

    Text is content unless it starts (after whitespace) with `{` or `[`. Once a call's header with a
    known function name is recognized, its arguments are streamed as they arrive; a JSON object in
    another key order is buffered whole and checked before it is reported as a call.
    """

    tool_names: Collection[str]
    prefix: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)
    _text: str = ""
    _pos: int = 0
    _state: str = "start"
    _in_array: bool = False
    _object_start: int = 0
    _scanner: _JsonScanner | None = None
    _scan_pos: int = 0
    _pending: list[ParserEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._pending = self.feed(self.prefix) if self.prefix else []

    @property
    def all_valid(self) -> bool:
        return bool(self.calls) and all(call.valid for call in self.calls)

    def feed(self, text: str) -> list[ParserEvent]:
        events, self._pending = self._pending, []
        # Out of the attribute while it grows: a string only a local holds is extended in place, where
        # `self._text += text` copies the whole text on every feed.
        buffered, self._text = self._text, ""
        buffered += text
        self._text = buffered
        while self._step(events):
            pass
        return events

    def finish(self, cut: bool = False) -> list[ParserEvent]:
        """`cut`: the output was cut short (max_tokens): a call whose name is whole is begun even where its
        arguments had not started, as far as it got."""
        events = self.feed("")
        if cut and self._state == "header":
            name = _header_name(self._text, self._object_start)
            if name in self.tool_names:
                self._start_call(events, name)
                self._state = "done"
                return events
        if not self.calls and self._state not in ("content", "done") and self._text:
            events.append(ContentDelta(self._text))
        self._state = "done"
        return events

    # Each state handler returns True when it made progress and False when it needs more text.
    def _step(self, events: list[ParserEvent]) -> bool:
        return getattr(self, f"_on_{self._state}")(events)

    def _next_char(self) -> str | None:
        self._pos = _skip_ws(self._text, self._pos)
        return self._text[self._pos] if self._pos < len(self._text) else None

    def _on_start(self, events: list[ParserEvent]) -> bool:
        c = self._next_char()
        if c is None:
            return False
        if c == "[":
            self._in_array = True
            self._pos += 1
            self._state = "object_start"
        elif c == "{":
            self._begin_object()
        else:
            self._fail()
        return True

    def _on_object_start(self, events: list[ParserEvent]) -> bool:
        c = self._next_char()
        if c is None:
            return False
        if c == "{":
            self._begin_object()
        elif c == "]" and self.calls:
            self._pos += 1
            self._state = "done"
        else:
            self._fail()
        return True

    def _begin_object(self) -> None:
        self._object_start = self._pos
        self._state = "header"

    def _on_header(self, events: list[ParserEvent]) -> bool:
        match = _match_header(self._text, self._object_start)
        if match == _PARTIAL:
            return False
        if match == _FAIL:
            self._scanner, self._scan_pos, self._state = _JsonScanner(), self._object_start, "whole"
            return True
        args_start, name = match  # type: ignore[misc]
        if name not in self.tool_names:
            self._fail()
            return True
        self._start_call(events, name)
        self._pos, self._scanner, self._state = args_start, _JsonScanner(), "arguments"
        return True

    def _start_call(self, events: list[ParserEvent], name: str) -> ParsedToolCall:
        call = ParsedToolCall(new_tool_call_id(), name)
        self.calls.append(call)
        events.append(ToolCallStart(len(self.calls) - 1, call.id, name))
        return call

    def _on_arguments(self, events: list[ParserEvent]) -> bool:
        assert self._scanner is not None
        end = self._scanner.scan(self._text, self._pos)
        stop = len(self._text) if end is None else end
        if stop > self._pos:
            piece = self._text[self._pos : stop]
            self.calls[-1].arguments += piece
            events.append(ToolArgumentsDelta(len(self.calls) - 1, piece))
            self._pos = stop
        if end is None:
            return False
        self._scanner, self._state = _JsonScanner(depth=1), "object_end"
        return True

    def _on_object_end(self, events: list[ParserEvent]) -> bool:
        # The rest of the call object (normally just `}`; extra keys are skipped).
        assert self._scanner is not None
        end = self._scanner.scan(self._text, self._pos)
        if end is None:
            self._pos = len(self._text)
            return False
        self._pos = end
        self.calls[-1].complete = True
        self._state = "separator" if self._in_array else "after"
        return True

    def _on_whole(self, events: list[ParserEvent]) -> bool:
        assert self._scanner is not None
        end = self._scanner.scan(self._text, self._scan_pos)
        if end is None:
            self._scan_pos = len(self._text)
            return False
        call = _call_from_json(self._text[self._object_start : end], self.tool_names)
        if call is None:
            self._fail()
            return True
        name, arguments = call
        parsed = self._start_call(events, name)
        parsed.arguments, parsed.complete = arguments, True
        events.append(ToolArgumentsDelta(len(self.calls) - 1, arguments))
        self._pos = end
        self._state = "separator" if self._in_array else "after"
        return True

    def _on_separator(self, events: list[ParserEvent]) -> bool:
        c = self._next_char()
        if c is None:
            return False
        self._pos += 1
        self._state = "object_start" if c == "," else "done"
        return True

    def _on_after(self, events: list[ParserEvent]) -> bool:
        # Several top-level objects may follow one another, separated by whitespace, ';' or ','.
        c = self._next_char()
        while c in (";", ","):
            self._pos += 1
            c = self._next_char()
        if c is None:
            return False
        if c == "{":
            self._begin_object()
        else:
            self._state = "done"
        return True

    def _on_content(self, events: list[ParserEvent]) -> bool:
        if self._pos < len(self._text):
            events.append(ContentDelta(self._text[self._pos :]))
            self._pos = len(self._text)
        return False

    def _on_done(self, events: list[ParserEvent]) -> bool:
        self._pos = len(self._text)  # text after the last call is not part of the answer
        return False

    def _fail(self) -> None:
        """Not a tool call: before any call everything is content; after one, the rest is dropped."""
        if self.calls:
            self._state = "done"
        else:
            self._state, self._pos = "content", 0


def _call_from_json(text: str, tool_names: Collection[str]) -> tuple[str, str] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads_or_raw(arguments)
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolParseResult:
    content: str | None
    calls: list[ParsedToolCall]


@dataclass
class MarkedToolCallParser:
    """Content until the opening marker; after it, JSON tool calls as `ToolCallParser` reads them, with every
    marker (closing ones, and openings of further calls) taken out of the text it is fed. A partial marker at
    the end of the text so far is held back until the next piece decides it."""

    tool_names: Collection[str]
    start: str
    end: str | None = None
    prefix: str = ""
    _inner: ToolCallParser | None = None
    _held: str = ""
    _pending: list[ParserEvent] = field(default_factory=list)
    _marker_owed: bool = False  # the opening marker, taken out, goes back into content if no call follows it

    def __post_init__(self) -> None:
        self._pending = self.feed(self.prefix) if self.prefix else []

    @property
    def calls(self) -> list[ParsedToolCall]:
        return self._inner.calls if self._inner is not None else []

    def _from_inner(self, events: list[ParserEvent]) -> list[ParserEvent]:
        """The inner parser's events, the first marker restored ahead of content its text turned out to be (as the
        whole output's text keeps it)."""
        if self._marker_owed:
            for i, event in enumerate(events):
                if isinstance(event, ContentDelta):
                    events[i] = ContentDelta(self.start + event.text)
                    self._marker_owed = False
                    break
                if isinstance(event, ToolCallStart):
                    self._marker_owed = False
                    break
        return events

    @property
    def all_valid(self) -> bool:
        return self._inner is not None and self._inner.all_valid

    def feed(self, text: str) -> list[ParserEvent]:
        events, self._pending = self._pending, []
        text, self._held = self._held + text, ""
        if self._inner is None:
            found = text.find(self.start)
            if found < 0:
                # Hold back a possible partial marker and the whitespace before it: if a call follows, that
                # whitespace is not part of the content.
                keep = _partial_suffix(text, (self.start,))
                content = text[: len(text) - keep].rstrip(_WS)
                if content:
                    events.append(ContentDelta(content))
                self._held = text[len(content):]
                return events
            if found and text[:found].strip():
                events.append(ContentDelta(text[:found].rstrip(_WS)))
            self._inner, self._marker_owed = ToolCallParser(self.tool_names), True
            text = text[found + len(self.start):]
        markers = tuple(m for m in (self.start, self.end) if m)
        for marker in markers:
            text = text.replace(marker, " ")
        keep = _partial_suffix(text, markers)
        self._held = text[len(text) - keep:] if keep else ""
        events += self._from_inner(self._inner.feed(text[: len(text) - keep]))
        return events

    def finish(self, cut: bool = False) -> list[ParserEvent]:
        held, self._held = self._held, ""
        if self._inner is None:
            return self._pending + ([ContentDelta(held)] if held else [])
        return self.feed("") + self._from_inner(self._inner.feed(held) + self._inner.finish(cut))


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of the markers."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def make_tool_parser(fmt: str, tool_names: Collection[str], prefix: str = "") -> ToolCallParser | MarkedToolCallParser:
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {list(TOOL_FORMATS)}")
    if fmt == "llama3_json":
        return ToolCallParser(tool_names, prefix)
    start, end = _MARKERS[fmt]
    return MarkedToolCallParser(tool_names, start, end, prefix)


def parse_tool_calls(text: str, tool_names: Collection[str], prefix: str = "",
                     fmt: str = "llama3_json", cut: bool = False) -> ToolParseResult:
    """Whole-output parsing: the calls if every one is complete valid JSON, else all text as content. `cut`: the
    output was cut short (max_tokens), so calls it began are returned as far as they got, as a stream of it
    would have sent them."""
    parser = make_tool_parser(fmt, tool_names, prefix)
    events = parser.feed(text) + parser.finish(cut)
    if parser.all_valid or (cut and parser.calls):
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return ToolParseResult(content or None, parser.calls)
    return ToolParseResult(prefix + text, [])
