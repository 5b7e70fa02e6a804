"""/v1/responses: the OpenAI Responses API's text subset, served by the chat completion path.

A request becomes the equivalent chat completion request (protocol_responses), which runs as any other (template,
tools, structured outputs, budgets); its answer, whole or streamed, is rewritten as a Response object or as the
Responses API's stream of events. Nothing is stored: `store: true` and `previous_response_id` are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.entrypoints.protocol_responses import ResponsesRequest, chat_param
from kestrel.entrypoints.serving import EventStreamResponse, OpenAIServing
from kestrel.request import InvalidRequestError


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_response(self, request: ResponsesRequest, raw: Request) -> Response:
        try:
            chat = request.to_chat()
            answer = await self.serving.create_chat_completion(chat, raw)
        except InvalidRequestError as error:
            raise InvalidRequestError(chat_param(error.param or "input"), str(error)) from None
        shell = _ResponseShell(request, self.serving.response_model_name(request.model))
        if isinstance(answer, EventStreamResponse):
            return EventStreamResponse(_events(shell, answer.body_iterator))
        if answer.status_code != 200:
            return answer
        body = json.loads(answer.body)
        choice = body["choices"][0]
        message = choice["message"]
        output = []
        if message.get("content") or not message.get("tool_calls"):
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", message.get("content") or "", "completed"))
        output += [_call_item(f"fc_{uuid.uuid4().hex}", call["id"], call["function"]["name"],
                              call["function"]["arguments"], "completed") for call in message.get("tool_calls") or []]
        return JSONResponse(shell.response(output, choice["finish_reason"], body["usage"]))


class _ResponseShell:
    """A Response object's fields other than its output: what the request asked for."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        tool_choice = request.tool_choice
        self.fields = {
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": model, "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False, "temperature": request.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": (tool_choice.model_dump() if hasattr(tool_choice, "model_dump")
                            else tool_choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "top_p": request.top_p, "truncation": "disabled", "user": request.user, "metadata": {},
        }

    def response(self, output: list[dict[str, Any]], finish_reason: str | None,
                 usage: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": "incomplete" if incomplete else "completed" if finish_reason else "in_progress",
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output, "usage": _usage(usage), **self.fields}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class _EventWriter:
    """The Responses events of one answer, numbered, with the output items they open and close."""

    def __init__(self, shell: _ResponseShell) -> None:
        self.shell = shell
        self.number = 0
        self.output: list[dict[str, Any]] = []  # items done
        self.text: dict[str, Any] | None = None  # the message item open, with its text so far
        self.calls: dict[int, dict[str, Any]] = {}  # function call items open, by the chat delta's index

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def lifecycle(self, kind: str, finish_reason: str | None = None, usage: dict[str, Any] | None = None) -> str:
        return self.event(kind, response=self.shell.response(list(self.output), finish_reason, usage))

    def text_delta(self, delta: str) -> list[str]:
        events = []
        if self.text is None:
            self.text = {"item": _message_item(f"msg_{uuid.uuid4().hex}", None, "in_progress"), "text": "",
                         "index": self._next_index()}
            events += [self.event("response.output_item.added", output_index=self.text["index"],
                                  item=self.text["item"]),
                       self.event("response.content_part.added", item_id=self.text["item"]["id"],
                                  output_index=self.text["index"], content_index=0, part=_text_part(""))]
        if delta:
            self.text["text"] += delta
            events.append(self.event("response.output_text.delta", item_id=self.text["item"]["id"],
                                     output_index=self.text["index"], content_index=0, delta=delta, logprobs=[]))
        return events

    def close_text(self, status: str) -> list[str]:
        if self.text is None:
            return []
        item_id, index, text = self.text["item"]["id"], self.text["index"], self.text["text"]
        self.text = None
        item = _message_item(item_id, text, status)
        self.output.append(item)
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=_text_part(text)),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call_delta(self, call: dict[str, Any]) -> list[str]:
        events = self.close_text("completed") if self.text is not None else []
        function = call.get("function") or {}
        open_call = self.calls.get(call["index"])
        if open_call is None:
            open_call = self.calls[call["index"]] = {
                "item": _call_item(f"fc_{uuid.uuid4().hex}", call.get("id") or f"call_{uuid.uuid4().hex}",
                                   function.get("name") or "", "", "in_progress"), "index": self._next_index()}
            events.append(self.event("response.output_item.added", output_index=open_call["index"],
                                     item=dict(open_call["item"])))
        delta = function.get("arguments") or ""
        if delta:
            open_call["item"]["arguments"] += delta
            events.append(self.event("response.function_call_arguments.delta", item_id=open_call["item"]["id"],
                                     output_index=open_call["index"], delta=delta))
        return events

    def close_calls(self) -> list[str]:
        events = []
        for open_call in self.calls.values():
            item = {**open_call["item"], "status": "completed"}
            self.output.append(item)
            events += [self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=open_call["index"], name=item["name"], arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=open_call["index"], item=item)]
        self.calls = {}
        return events

    def _next_index(self) -> int:
        return len(self.output) + (self.text is not None) + len(self.calls)


async def _events(shell: _ResponseShell, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The chat completion's SSE chunks rewritten as the Responses stream: response.created, in_progress, each
    output item added, its deltas and done, then response.completed with the whole response (status
    `incomplete` when max_output_tokens ended it, as its incomplete_details say)."""
    writer = _EventWriter(shell)
    finish_reason: str | None = None
    try:
        yield writer.lifecycle("response.created")
        yield writer.lifecycle("response.in_progress")
        async for chunk in chunks:
            data = chunk.decode() if isinstance(chunk, bytes) else chunk
            payload = data.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            body = json.loads(payload)
            if "error" in body:  # the chat stream failed after its status line: the Responses error event
                error = body["error"]
                yield writer.event("error", code=error.get("code"), message=error.get("message"),
                                   param=error.get("param"))
                return
            for choice in body.get("choices") or []:
                delta = choice.get("delta") or {}
                for event in writer.text_delta(delta["content"]) if delta.get("content") else []:
                    yield event
                for call in delta.get("tool_calls") or []:
                    for event in writer.call_delta(call):
                        yield event
                finish_reason = choice.get("finish_reason") or finish_reason
            if body.get("usage") and not body.get("choices"):
                if writer.text is None and not writer.output and not writer.calls:
                    for event in writer.text_delta(""):
                        yield event  # an empty answer is still one message, as the whole response has
                status = "incomplete" if finish_reason == "length" else "completed"
                for event in writer.close_text(status) + writer.close_calls():
                    yield event
                yield writer.lifecycle("response.completed", finish_reason, body["usage"])
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
