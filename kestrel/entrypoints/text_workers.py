"""The server's heavy text work (prompt tokenization, chat templating, /tokenize and /detokenize replies) away from
the event loop: in worker processes (`processes > 0`), each with its own tokenizer, so that a multi-megabyte prompt
costs the serving process only the transfer of its result; else in a worker thread of the serving process
(tests, and servers that want no extra processes).

Results stay small: a prompt that cannot fit the context comes back as its token count alone, and the /tokenize
and /detokenize replies come back as finished JSON bytes.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from kestrel.entrypoints.chat import ChatPrompt, encode_chat, render_chat


@dataclass(frozen=True)
class ChatInput:
    """What a chat request's template needs, picklable for a worker process."""

    messages: list[dict[str, Any]]
    message_texts: list[str]  # each message's own text: special-token text in it stays plain text
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"
    named_tool: str | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # the request's, else the server's --chat-template, else the tokenizer's
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None


# ----- the work (module functions: a worker process runs them by name) -----------------------------------

def encode_prompt(tokenizer: Any, specials: Sequence[str], text: str, limit: int | None,
                  add_special_tokens: bool = True) -> tuple[int, list[int] | None]:
    """(token count, ids), the ids None when there are `limit` or more (the caller only reports the count)."""
    return _within(tokenizer.encode(text, add_special_tokens=add_special_tokens), limit)


def _within(ids: list[int], limit: int | None) -> tuple[int, list[int] | None]:
    return len(ids), (ids if limit is None or len(ids) < limit else None)


def render_and_encode(tokenizer: Any, specials: Sequence[str], chat: ChatInput,
                      limit: int | None) -> tuple[ChatPrompt, int, list[int] | None]:
    prompt = render_chat(tokenizer, chat.messages, tools=chat.tools, tool_choice=chat.tool_choice,
                         named_tool=chat.named_tool, add_generation_prompt=chat.add_generation_prompt,
                         chat_template=chat.chat_template, continue_final_message=chat.continue_final_message,
                         template_kwargs=chat.template_kwargs)
    return (prompt, *_within(encode_chat(tokenizer, prompt.text, chat.message_texts, specials), limit))


def tokenize_reply(tokenizer: Any, specials: Sequence[str], prompt: str | ChatInput, add_special_tokens: bool,
                   max_model_len: int) -> bytes:
    """The /tokenize response body."""
    if isinstance(prompt, ChatInput):
        ids = render_and_encode(tokenizer, specials, prompt, None)[2] or []
    else:
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return json.dumps({"count": len(ids), "max_model_len": max_model_len, "tokens": ids},
                      separators=(",", ":")).encode()


def detokenize_reply(tokenizer: Any, specials: Sequence[str], token_ids: list[int]) -> bytes:
    """The /detokenize response body."""
    return json.dumps({"prompt": tokenizer.decode(token_ids)}, ensure_ascii=False).encode()


# ----- worker processes -----------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_worker_tokenizer: Any = None
_worker_specials: tuple[str, ...] = ()


def _init_worker(tokenizer_path: str, specials: tuple[str, ...], trust_remote_code: bool) -> None:
    global _worker_tokenizer, _worker_specials
    from kestrel.loader.tokenizer import load_tokenizer

    _end_with_parent()
    # Batch work: below the serving process's priority, so its event loop and the engine get the cores first.
    os.nice(5)
    _worker_tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
    _worker_specials = specials


def _end_with_parent() -> None:
    """A worker dies with the serving process, even a killed one (Linux: PR_SET_PDEATHSIG), rather than finishing
    a long tokenization nobody waits for."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)


def _in_worker(work: Callable[..., Any], *args: Any) -> Any:
    return work(_worker_tokenizer, _worker_specials, *args)


class TextWorkers:
    def __init__(self, tokenizer: Any, specials: Sequence[str], *, tokenizer_path: str | None = None,
                 processes: int = 0, chat_template: str | None = None, trust_remote_code: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.specials = tuple(specials)
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        if processes > 0:
            if not tokenizer_path:
                raise ValueError("tokenizer worker processes need the tokenizer's directory")
            # Spawned, not forked: the serving process runs the engine thread (and CUDA) already.
            self._pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker,
                                             initargs=(tokenizer_path, self.specials, trust_remote_code))

    def start(self) -> TextWorkers:
        """Start every worker and load its tokenizer now, so the first requests do not wait for it."""
        if self._pool is not None:
            for future in [self._pool.submit(_in_worker, encode_prompt, "warm up", None)
                           for _ in range(self.processes)]:
                future.result()
        return self

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, work: Callable[..., Any], *args: Any) -> Any:
        if self._pool is None:
            return await asyncio.to_thread(work, self.tokenizer, self.specials, *args)
        return await asyncio.wrap_future(self._pool.submit(_in_worker, work, *args))

    async def encode_prompts(self, texts: list[str], limit: int | None,
                             add_special_tokens: bool = True) -> list[tuple[int, list[int] | None]]:
        return list(await asyncio.gather(*(self._run(encode_prompt, text, limit, add_special_tokens)
                                           for text in texts)))

    async def render_chat(self, chat: ChatInput, limit: int | None) -> tuple[ChatPrompt, int, list[int] | None]:
        return await self._run(render_and_encode, self._with_template(chat), limit)

    async def tokenize_reply(self, prompt: str | ChatInput, add_special_tokens: bool, max_model_len: int) -> bytes:
        if isinstance(prompt, ChatInput):
            prompt = self._with_template(prompt)
        return await self._run(tokenize_reply, prompt, add_special_tokens, max_model_len)

    def _with_template(self, chat: ChatInput) -> ChatInput:
        if self.chat_template is None or chat.chat_template is not None:
            return chat
        return dataclasses.replace(chat, chat_template=self.chat_template)

    async def detokenize_reply(self, token_ids: list[int]) -> bytes:
        return await self._run(detokenize_reply, token_ids)
