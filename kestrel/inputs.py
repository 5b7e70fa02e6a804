"""The prompt forms `LLM` and `AsyncLLM` take besides plain text, typed as vLLM's `vllm.inputs` types them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""

    prompt: str
    multi_modal_data: NotRequired[Any]  # a multimodal model's {"image": image or list of images}
    # Part of the first prefix-cache block's hash: only prompts with the same salt share cached blocks.
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids (any sequence of integers); `prompt`, when given, is its text for the outputs."""

    prompt_token_ids: Sequence[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[Any]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt
# The keys a prompt dict may hold: every key of the two forms.
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "cache_salt")


def cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's cache_salt, None without one (the engine checks it)."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None
