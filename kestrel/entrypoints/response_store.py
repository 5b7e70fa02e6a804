"""The response store behind /v1/responses' `store` and `previous_response_id` (`--enable-response-store`): the
responses answered, in memory, at most `max_entries` of them, the least recently used dropped first.

Each entry keeps the Response object as it was answered and the conversation it ends: the input items of the
responses it continued, its own input items and its output items. A continuation prepends that conversation to its
own input, so an entry never needs the entries before it, and dropping one breaks no other.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kestrel.entrypoints.protocol_responses import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ReasoningText,
)


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object answered (or the one response.completed carried)
    conversation: tuple[InputItem, ...]  # what a continuation prepends to its input

    @property
    def id(self) -> str:
        return self.body["id"]


class ResponseStore:
    """Used from the event loop only, so it needs no lock."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"invalid max_entries={max_entries}: expected >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: StoredResponse) -> None:
        self._entries[response.id] = response
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        response = self._entries.get(response_id)
        if response is not None:
            self._entries.move_to_end(response_id)
        return response

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def output_as_input(item: dict[str, Any]) -> InputItem:
    """A Response's output item (a message, a function call or reasoning) as the input item that sends it back."""
    if item["type"] == "reasoning":
        return ReasoningItem(type="reasoning", content=[ReasoningText(type="reasoning_text", text=part["text"])
                                                        for part in item["content"]], id=item["id"],
                             status=item["status"])
    if item["type"] == "function_call":
        return FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                                arguments=item["arguments"], id=item["id"], status=item["status"])
    text = "".join(part["text"] for part in item["content"])
    return MessageItem(type="message", role="assistant", content=text, id=item["id"], status=item["status"])
