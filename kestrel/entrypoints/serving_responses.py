"""/v1/responses: the OpenAI Responses API's text subset, served by the chat completion path.

A request becomes the equivalent chat completion request (protocol_responses), which runs as any other (template,
tools, structured outputs, budgets); its answer, whole or streamed, is rewritten as a Response object or as the
Responses API's stream of events. With `--enable-response-store` the answers are kept (response_store.py): stored
ones can be read back and deleted, and `previous_response_id` continues one; without it, `store: true` and
`previous_response_id` are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.entrypoints.protocol_responses import InputItem, ResponsesRequest, chat_param
from kestrel.entrypoints.response_store import ResponseStore, StoredResponse, output_as_input
from kestrel.entrypoints.serving import EventStreamResponse, OpenAIServing, error_body
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SamplingParams

_STORE_OFF = "this server keeps no responses unless it is started with --enable-response-store"


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        config = serving.config
        self.store = ResponseStore(config.response_store_max_entries) if config.enable_response_store else None

    async def create_response(self, request: ResponsesRequest, raw: Request) -> Response:
        keep = self._keeps(request)
        history: tuple[InputItem, ...] = ()
        if request.previous_response_id is not None:
            assert self.store is not None  # _keeps refused it otherwise
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                return _not_found(request.previous_response_id, "previous_response_id")
            history = previous.conversation  # its instructions are not carried over, as in OpenAI's API
        try:
            chat = request.to_chat(history)
            answer = await self.serving.create_chat_completion(chat, raw)
        except InvalidRequestError as error:
            raise InvalidRequestError(chat_param(error.param or "input"), str(error)) from None
        shell = _ResponseShell(request, self.serving.response_model_name(request.model), keep,
                               self.serving.engine.generation_defaults.sampling)
        asked = (*history, *request.input_items())

        def save(response: dict[str, Any], output: list[dict[str, Any]]) -> None:
            if keep and self.store is not None:
                conversation = (*asked, *(output_as_input(item) for item in output))
                self.store.put(StoredResponse(response, conversation))

        if isinstance(answer, EventStreamResponse):
            return EventStreamResponse(_events(shell, answer.body_iterator, save), on_close=answer.on_close)
        if answer.status_code != 200:
            return answer
        body = json.loads(answer.body)
        choice = body["choices"][0]
        message = choice["message"]
        output = []
        # Cut by max_output_tokens: the last item (the thinking, the message or the last call) is incomplete.
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        reasoning = message.get("reasoning")
        calls = message.get("tool_calls") or []
        if reasoning is not None:
            cut = not message.get("content") and not calls  # the thinking is all there is
            output.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", reasoning, status if cut else "completed"))
        if message.get("content") or not (calls or reasoning is not None):
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", message.get("content") or "", status,
                                        _logprobs(choice)))
        output += [_call_item(f"fc_{uuid.uuid4().hex}", call["id"], call["function"]["name"],
                              call["function"]["arguments"], status if i == len(calls) - 1 else "completed")
                   for i, call in enumerate(calls)]
        response = shell.response(output, choice["finish_reason"], body["usage"])
        save(response, output)
        return JSONResponse(response)

    def retrieve_response(self, response_id: str, query: Mapping[str, str]) -> Response:
        """GET /v1/responses/{id}: a stored Response object, as it was answered. Replaying its events (`stream`
        true, `starting_after`) and `include` are refused by name."""
        for name, value in query.items():
            if name != "stream" or value.lower() not in ("false", "0"):
                return JSONResponse(error_body(f"{name} is not supported when retrieving a response: this server "
                                               "returns the stored Response object only", "invalid_request_error",
                                               name, "unsupported_parameter"), status_code=400)
        stored = self.store.get(response_id) if self.store is not None else None
        return JSONResponse(stored.body) if stored is not None else _not_found(response_id, "response_id",
                                                                                self.store is None)

    def delete_response(self, response_id: str) -> Response:
        if self.store is None or not self.store.delete(response_id):
            return _not_found(response_id, "response_id", self.store is None)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def cancel_response(self, response_id: str) -> Response:
        """Only background responses can be cancelled, and this server runs none (`background: true` is
        refused): a stored response has finished, anything else is unknown."""
        if self.store is None or self.store.get(response_id) is None:
            return _not_found(response_id, "response_id", self.store is None)
        return JSONResponse(error_body(f"response {response_id!r} cannot be cancelled: only background responses "
                                       "can be, and this server runs none (this one has finished)",
                                       "invalid_request_error", "response_id", "not_cancellable"), status_code=400)

    def _keeps(self, request: ResponsesRequest) -> bool:
        """Whether the response is to be stored: `store` as asked, true by default as in OpenAI's API, when the
        store is on; never when it is off, and then asking for it is refused."""
        if self.store is not None:
            return request.store is not False
        if request.store:
            raise InvalidRequestError("store", f"{_STORE_OFF}: send store false or leave it out, and send the "
                                      "conversation so far as input items")
        if request.previous_response_id is not None:
            raise InvalidRequestError("previous_response_id", f"{_STORE_OFF}, so it cannot continue one: send the "
                                      "conversation so far as input items instead")
        return False


def _not_found(response_id: str, param: str, store_off: bool = False) -> JSONResponse:
    shown = response_id[:80]  # the client chooses the id: its echo is capped
    why = f" ({_STORE_OFF})" if store_off else " (never stored, deleted, or dropped from the full store)"
    return JSONResponse(error_body(f"no response with id {shown!r}{why}", "invalid_request_error", param,
                                   "response_not_found"), status_code=404)


class _ResponseShell:
    """A Response object's fields other than its output: what the request asked for."""

    def __init__(self, request: ResponsesRequest, model: str, stored: bool,
                 model_defaults: Mapping[str, Any]) -> None:
        """`model_defaults`: the model's generation_config settings, which the temperature and top_p a request
        leaves out take (the response reports the values used, as OpenAI's does)."""
        self.id = f"resp_{uuid.uuid4().hex}"

        def used(name: str, given: float | None) -> float:
            return given if given is not None else model_defaults.get(name, SamplingParams.default(name))

        self.created_at = int(time.time())
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        tool_choice = request.tool_choice
        self.fields = {
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": model, "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "store": stored,
            "temperature": used("temperature", request.temperature),
            "reasoning": ({"effort": request.reasoning.effort, "summary": None}
                          if request.reasoning is not None else None),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": (tool_choice.model_dump() if hasattr(tool_choice, "model_dump")
                            else tool_choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "top_p": used("top_p", request.top_p), "truncation": "disabled", "user": request.user, "metadata": {},
            "top_logprobs": request.top_logprobs or 0,
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
    # The chat usage's details where the server reports them (--enable-prompt-tokens-details, --reasoning-parser).
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}


def _message_item(item_id: str, text: str | None, status: str,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk choice's) logprobs of its content tokens, which the Responses API's output text
    carries in the same form ({token, logprob, bytes, top_logprobs}); none unless asked for (`include`)."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


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
        self.reasoning: dict[str, Any] | None = None  # the reasoning item open, with its text so far
        self.calls: dict[int, dict[str, Any]] = {}  # function call items open, by the chat delta's index
        self.held_logprobs: list[dict[str, Any]] = []  # of tokens whose text has not come yet

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def lifecycle(self, kind: str, finish_reason: str | None = None, usage: dict[str, Any] | None = None) -> str:
        return self.event(kind, response=self.shell.response(list(self.output), finish_reason, usage))

    def reasoning_delta(self, delta: str) -> list[str]:
        events = []
        if self.reasoning is None:
            self.reasoning = {"item": _reasoning_item(f"rs_{uuid.uuid4().hex}", None, "in_progress"), "parts": [],
                              "index": self._next_index()}
            events.append(self.event("response.output_item.added", output_index=self.reasoning["index"],
                                     item=self.reasoning["item"]))
        self.reasoning["parts"].append(delta)
        events.append(self.event("response.reasoning_text.delta", item_id=self.reasoning["item"]["id"],
                                 output_index=self.reasoning["index"], content_index=0, delta=delta))
        return events

    def _finished(self, opened: dict[str, Any], make: Callable[[str, str, str], dict[str, Any]],
                  status: str) -> tuple[str, int, str, dict[str, Any]]:
        """An open item's id, output index and text, and its final form (`make`), now in the output."""
        # The text was kept in its deltas (joined once here: appending each delta to one string copies it whole).
        item_id, index, text = opened["item"]["id"], opened["index"], "".join(opened["parts"])
        item = make(item_id, text, status)
        self.output.append(item)
        return item_id, index, text, item

    def close_reasoning(self, status: str = "completed") -> list[str]:
        if self.reasoning is None:
            return []
        item_id, index, text, item = self._finished(self.reasoning, _reasoning_item, status)
        self.reasoning = None
        return [self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text),
                self.event("response.output_item.done", output_index=index, item=item)]

    def text_delta(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        events = self.close_reasoning()
        if self.text is None:
            self.text = {"item": _message_item(f"msg_{uuid.uuid4().hex}", None, "in_progress"), "parts": [],
                         "logprobs": [], "index": self._next_index()}
            events += [self.event("response.output_item.added", output_index=self.text["index"],
                                  item=self.text["item"]),
                       self.event("response.content_part.added", item_id=self.text["item"]["id"],
                                  output_index=self.text["index"], content_index=0, part=_text_part(""))]
        if delta:
            logprobs, self.held_logprobs = self.held_logprobs + (logprobs or []), []
            self.text["parts"].append(delta)
            self.text["logprobs"] += logprobs
            events.append(self.event("response.output_text.delta", item_id=self.text["item"]["id"],
                                     output_index=self.text["index"], content_index=0, delta=delta,
                                     logprobs=logprobs))
        return events

    def close_text(self, status: str) -> list[str]:
        if self.text is None:
            return []
        logprobs, self.held_logprobs = self.text["logprobs"] + self.held_logprobs, []
        item_id, index, text, item = self._finished(
            self.text, lambda item_id, text, status: _message_item(item_id, text, status, logprobs), status)
        self.text = None
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=logprobs),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=_text_part(text, logprobs)),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call_delta(self, call: dict[str, Any]) -> list[str]:
        events = self.close_reasoning() + (self.close_text("completed") if self.text is not None else [])
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

    def close_calls(self, last_status: str = "completed") -> list[str]:
        """Every open call done; the last one with `last_status` (incomplete where max_output_tokens cut it)."""
        events = []
        last = max(self.calls, default=None)
        for key, open_call in self.calls.items():
            item = {**open_call["item"], "status": last_status if key == last else "completed"}
            self.output.append(item)
            events += [self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=open_call["index"], name=item["name"], arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=open_call["index"], item=item)]
        self.calls = {}
        return events

    def _next_index(self) -> int:
        return len(self.output) + (self.reasoning is not None) + (self.text is not None) + len(self.calls)


async def _events(shell: _ResponseShell, chunks: AsyncIterator[Any],
                  save: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> AsyncIterator[str]:
    """The chat completion's SSE chunks rewritten as the Responses stream: response.created, in_progress, each
    output item added, its deltas and done, then response.completed with the whole response (status
    `incomplete` when max_output_tokens ended it, as its incomplete_details say), which is then `save`d with its
    output items; a stream that fails or is cut off saves nothing."""
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
                for event in writer.reasoning_delta(delta["reasoning"]) if delta.get("reasoning") else []:
                    yield event
                if delta.get("content"):
                    for event in writer.text_delta(delta["content"], _logprobs(choice)):
                        yield event
                else:  # a token whose text is held back (a character split across tokens) comes with the next
                    writer.held_logprobs += _logprobs(choice)
                for call in delta.get("tool_calls") or []:
                    for event in writer.call_delta(call):
                        yield event
                finish_reason = choice.get("finish_reason") or finish_reason
            if body.get("usage") and not body.get("choices"):
                if writer.text is None and writer.reasoning is None and not writer.calls and not writer.output:
                    for event in writer.text_delta(""):
                        yield event  # an empty answer is still one message, as the whole response has
                status = "incomplete" if finish_reason == "length" else "completed"
                # Still open at the end: the thinking was all there was (cut while thinking, or no answer after it).
                for event in writer.close_reasoning(status) + writer.close_text(status) + writer.close_calls(status):
                    yield event
                response = writer.shell.response(list(writer.output), finish_reason, body["usage"])
                save(response, writer.output)
                # response.completed whatever the status (the response says it): the openai client's stream
                # helper takes its final response from that event only.
                yield writer.event("response.completed", response=response)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
