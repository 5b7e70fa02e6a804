"""The OpenAI Responses API's request schema (its text subset) and its translation into a chat completion request.

Parsed as strictly as protocol.py's models (the same base): an unknown field is a 400 naming it. What has no
counterpart here is refused by name: `background: true`, `truncation: "auto"`, `reasoning.summary`, an `include` other
than the output text's logprobs, and every other field of OpenAI's that this server does not know. `store` and
`previous_response_id` are the serving layer's to judge (they need the response store, which is off by default).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from kestrel.entrypoints.protocol import (
    ChatCompletionRequest,
    Int,
    _bounded,
    _Request,
    validation_error_info,
)
from kestrel.request import InvalidRequestError


class InputText(_Request):
    # output_text: an assistant message of an earlier response, sent back as conversation history.
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Request):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    # An earlier response's item sent back carries its id and status: they describe it, and ask for nothing.
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Request):
    """An earlier response's reasoning item (a --reasoning-parser server's) sent back: its text reaches the chat
    template as the following assistant turn's `reasoning_content`."""

    type: Literal["reasoning"]
    content: list[ReasoningText] = Field(default_factory=list)
    # This server writes no summaries (a summary is a model's own, not the thinking): an item with one is refused.
    summary: Annotated[list[Any], Field(max_length=0)] = Field(default_factory=list)
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
# What a Responses request's union fields take, for its validation errors (protocol.validation_error_info).
RESPONSES_HINTS = {"input": "a string or a non-empty list of input items (messages, function calls, function call "
                            "outputs, reasoning items)"}


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Request):
    # Handed to the chat template as the chat request's reasoning_effort; no summaries are written here.
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: _bounded(Int, "max_tokens", "max_output_tokens") | None = None
    temperature: _bounded(float, "temperature") | None = None
    top_p: _bounded(float, "top_p") | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    # The output text's logprobs (the chat completion's, per token) come with `include` naming them; top_logprobs
    # adds that many alternatives to each.
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: _bounded(Int, "logprobs", "top_logprobs") | None = None

    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    def input_items(self) -> list[InputItem]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(type="message", role="user", content=self.input)]
        return list(self.input)

    def to_chat(self, history: Sequence[InputItem] = ()) -> ChatCompletionRequest:
        """The equivalent chat completion request: instructions as a leading system message, then `history` (the
        stored conversation that previous_response_id continues) and the input items as messages (function calls
        as an assistant's tool_calls, their outputs as tool messages)."""
        if self.background:
            raise InvalidRequestError("background", "background responses are not supported: leave background out "
                                      "or false, and the answer comes in the reply (or its stream)")
        if self.reasoning is not None and self.reasoning.summary is not None:
            raise InvalidRequestError("reasoning.summary", "reasoning summaries are not written here: leave "
                                      "reasoning.summary out (with --reasoning-parser the thinking itself comes as a "
                                      "reasoning item's content)")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(history), "stream": self.stream}
        for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.wants_logprobs():
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        elif self.top_logprobs:
            raise InvalidRequestError("top_logprobs", "top_logprobs adds alternatives to the output text's logprobs, "
                                      "which come with include: [\"message.output_text.logprobs\"]; add it, or "
                                      "leave top_logprobs out")
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
            body["response_format"] = {"type": fmt.type, **({"json_schema": {k: v for k, v in schema.items()
                                                                              if v is not None}}
                                                             if fmt.type == "json_schema" else {})}
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as error:
            param, message = validation_error_info(error.errors(include_url=False))
            raise InvalidRequestError(chat_param(param or "input"), message) from None

    def _messages(self, history: Sequence[InputItem]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        reasoning: str | None = None  # a reasoning item's text, for the assistant turn after it
        for item in [*history, *self.input_items()]:
            if isinstance(item, ReasoningItem):
                reasoning = (reasoning or "") + item.text()
                continue
            if reasoning is not None and not (isinstance(item, FunctionCallItem)
                                              or (isinstance(item, MessageItem) and item.role == "assistant")):
                # A thinking with no answer after it (cut by max_output_tokens, or nothing said): its own turn.
                messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
                reasoning = None
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not last.get("content") and reasoning is None:
                    last.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            if reasoning is not None:
                messages[-1]["reasoning_content"] = reasoning
                reasoning = None
        if reasoning is not None:
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
        return messages


# The chat request's fields that a Responses request sets under another name, for the errors the chat path raises.
_CHAT_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                ("max_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
                ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("tools", "tools"), ("top_logprobs", "top_logprobs"), ("reasoning_effort", "reasoning.effort"))


def chat_param(param: str) -> str:
    """The Responses field behind a chat request's field (an error's param); a chat tool's `function` wrapper is
    flat in a Responses tool (`tools[0].function.parameters` is `tools[0].parameters`)."""
    param = re.sub(r"^(tools\[\d+\])\.function(?=\.|$)", r"\1", param)
    for chat, ours in _CHAT_PARAMS:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return ours + param[len(chat):] if chat != "messages" else "input"
    return param
