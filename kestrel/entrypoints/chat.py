"""Chat templates: messages -> prompt token ids through the tokenizer's own template."""

from __future__ import annotations

from typing import Any

from kestrel.request import InvalidRequestError


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("messages", "this model's tokenizer has no chat template; use a completion "
                                  "prompt instead, or pass chat_template")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InvalidRequestError("messages", "messages must be a list of {'role': ..., 'content': ...} dicts")
    rendered = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)
