"""A reasoning model's thinking apart from its answer (`--reasoning-parser`, vLLM's names): chat answers carry the
text between the think tags as `reasoning` (and `reasoning_content`, its older name) and the rest as `content`.

Both parsers read `<think> ... </think>`, in the answer's part of the prompt (`answer_prompt`: after the last
message the answer does not continue, so a tag a user merely mentions opens nothing) and in the answer. An answer
is in its thinking from the start when the model opens it (`<think>` first, dropped) or the prompt did (its last
`<think>` is open: the chat template's, or the one of an assistant message the answer continues); `deepseek_r1`
starts there unless the prompt closed it (DeepSeek-R1 may begin its thinking without the tag). Thinking ends at
`</think>` (dropped); an answer that never closes it is all reasoning. A prompt that ends with its thinking closed
(a template with thinking turned off) makes the whole answer content, and so does `qwen3` without an opening. A
whole answer and its stream split alike: both run `ReasoningSplitter`. A structured answer thinks first too: where
both tags are single tokens, its grammar applies after the thinking (`thinking_at_start`,
`StructuredOutputsParams.after_thinking`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def opened_by_prompt(prompt_text: str) -> bool:
    """Whether the rendered chat prompt starts the answer inside its thinking: its last `<think>` is not closed
    (the template opened it for the answer, or the assistant message the answer continues holds it)."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


def thinking_at_start(parser: str, prompt_text: str) -> bool | None:
    """Where an answer starts, from the answer's part of the rendered chat prompt (`answer_prompt`): inside its
    thinking (True: the prompt opened it, or `deepseek_r1`, which may think without the tag), free to open it with its
    first token (False), or past it (None: the prompt closed it, as a template with thinking turned off writes it, or
    an assistant message the answer continues)."""
    if opened_by_prompt(prompt_text):
        return True
    if THINK_END in prompt_text:  # closed after its last opening: the template's, or a continued message's
        return None
    return parser == "deepseek_r1"


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (kept until the next text says)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def answer_prompt(prompt_text: str, messages: list[dict[str, Any]]) -> int:
    """Where the answer's own part of a rendered chat prompt starts: after the last message the answer does not
    continue (the last one not the assistant's), so that a `<think>` a user, system or tool message merely
    mentions opens nothing; the template's generation prompt and an assistant message the answer continues lie
    after it. The messages are found in order, each after the one before (a short text is not taken for a piece
    of a later one); 0 when a message that is not the assistant's is not found as written (a template that
    rewrites it)."""
    position, start = 0, 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # content parts: the last text part ends the message
            texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            content = texts[-1] if texts else None
        own = message.get("role") != "assistant"
        if not isinstance(content, str) or not content:
            if own:
                return 0
            continue
        found = prompt_text.find(content, position)
        if found < 0:
            if own:
                return 0
            continue  # an assistant message the template rewrote (its thinking dropped, say)
        position = found + len(content)
        if own:
            start = position
    return start


class ReasoningSplitter:
    """One answer's text, fed as it comes, split into (reasoning, content) pieces. `start`: where the answer starts
    (`thinking_at_start`): inside its thinking, free to open it with a leading `<think>`, or past it (None: all of
    it is content)."""

    def __init__(self, parser: str, start: bool | None) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; expected one of {list(REASONING_PARSERS)}")
        self._thinking = start is True
        self._at_start = start is not None  # a leading <think> may still come (dropped where already inside)
        self._pending = ""

    @property
    def thinking(self) -> bool:
        """Whether the text so far is inside the thinking (a leading tag not yet complete counts as outside)."""
        return self._thinking and not (self._at_start and self._pending)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) that `text` adds; `final`: the answer ends here (nothing is held back)."""
        pending = self._pending + text
        self._pending = ""
        if self._at_start:
            if not final and len(pending) < len(THINK_START) and THINK_START.startswith(pending):
                self._pending = pending
                return "", ""
            self._at_start = False
            if pending.startswith(THINK_START):
                pending = pending[len(THINK_START):]
                self._thinking = True
        if not self._thinking:
            return "", pending
        end = pending.find(THINK_END)
        if end >= 0:
            self._thinking = False
            return pending[:end], pending[end + len(THINK_END):]
        keep = 0 if final else _held_back(pending, THINK_END)
        self._pending = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep], ""


def count_reasoning_tokens(parser: str, start: bool | None, token_texts: Iterable[str]) -> int:
    """An answer's reasoning tokens, from each token's text: those up to the one that ends its thinking, all of
    them when it never ends, none when it does not think."""
    splitter = ReasoningSplitter(parser, start)
    count, thought = 0, False
    for count, text in enumerate(token_texts, 1):
        reasoning, content = splitter.feed(text)
        thought = thought or bool(reasoning) or splitter.thinking
        if thought and not splitter.thinking:
            return count
    return count if thought else 0


def split_reasoning(parser: str, text: str, start: bool | None) -> tuple[str | None, str]:
    """A whole answer's (reasoning or None, content)."""
    reasoning, content = ReasoningSplitter(parser, start).feed(text, final=True)
    return reasoning or None, content
