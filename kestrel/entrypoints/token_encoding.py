"""Prompt encoding shared by the server's tokenizer workers and the offline `LLM`: plain functions of a
tokenizer, free of the server's request models (pydantic), so `LLM` imports without them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_prompt(tokenizer: Any, specials: Sequence[str], text: str, limit: int | None,
                  add_special_tokens: bool = True) -> tuple[int, list[int] | None]:
    """(token count, ids), the ids None when there are `limit` or more (the caller only reports the count)."""
    return within_limit(tokenizer.encode(text, add_special_tokens=add_special_tokens), limit)


def encode_pair(tokenizer: Any, specials: Sequence[str], text: str, text_pair: str,
                limit: int | None) -> tuple[int, list[int] | None]:
    """A cross-encoder's input: the two texts as one sequence by the tokenizer's pair template."""
    return within_limit(list(tokenizer.encode(text, text_pair, add_special_tokens=True)), limit)


def within_limit(ids: list[int], limit: int | None) -> tuple[int, list[int] | None]:
    return len(ids), (ids if limit is None or len(ids) < limit else None)
