"""The server's heavy text work (prompt tokenization, chat templating, /tokenize and /detokenize replies) away from
the event loop: in a `WorkerPool` of tokenizer processes (`processes > 0`), each with its own tokenizer, so that a
multi-megabyte prompt costs the serving process only the transfer of its result; else in worker threads of the
serving process (tests, and servers that want no extra processes).

Fairness: a job of more than HEAVY_TEXT_BYTES of text (or HEAVY_TOKEN_IDS ids to detokenize) is heavy, and heavy
jobs hold at most part of the workers (the pool's lanes), so a small prompt never waits behind big ones. A big
prompt is not cut into pieces tokenized in parallel: a tokenizer's pre-tokenization and merges may cross any cut,
so the ids could differ from one encode of the whole text.

Bounds: every job has the request's deadline (`timeout`, --tokenize-timeout): past it the request gets a 400
naming its prompt field and the flag, and its worker is killed and replaced; a job whose awaiting task is
cancelled (its client went away) costs its worker the same way. /tokenize takes at most `max_tokenize_bytes` of
prompt text (--max-tokenize-bytes).

Results stay small: a prompt that cannot fit the context comes back as its token count alone, and the /tokenize
and /detokenize replies come back as finished JSON bytes. A large /tokenize body travels raw (`tokenize_body`):
the worker parses and validates it, so the serving process never decodes the prompt at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kestrel.entrypoints.chat import ChatPrompt, encode_chat, render_chat
from kestrel.entrypoints.protocol import ChatMessage, TokenizeChatRequest, TokenizeRequest, validation_error_info
from kestrel.entrypoints.token_encoding import encode_pair, encode_prompt, within_limit
from kestrel.entrypoints.worker_pool import WorkerPool, WorkTimeoutError
from kestrel.loader.tokenizer import tokenizer_modules
from kestrel.request import InvalidRequestError
from kestrel.structured.compile import release_memory

HEAVY_TEXT_BYTES = 64 << 10  # ~16k tokens: tens of milliseconds of tokenizing, the most a light job may take
HEAVY_TOKEN_IDS = 16 << 10


@dataclass(frozen=True)
class ChatInput:
    """What a chat request's template needs, picklable for a worker process."""

    messages: list[dict[str, Any]]
    # each message's role and own text, in the order a template renders them: special-token text in them stays
    # plain text (a role is any string the template renders, as in vLLM, so it is the client's text too)
    message_texts: list[str]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"
    named_tool: str | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # the request's, else the server's --chat-template, else the tokenizer's
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None
    content_parts: bool = False  # a multimodal model's template reads content as text and image parts
    close_thinking: bool = False  # a grammar shapes the answer: a thinking the template opened is closed first
    tool_parser: str | None = None  # the server's --tool-call-parser (TextWorkers sets it): calls' format
    exclude_tools_when_none: bool = False  # the server's --exclude-tools-when-tool-choice-none (TextWorkers too)
    content_format: str = "auto"  # the server's --chat-template-content-format (TextWorkers too)


def chat_input(messages: Sequence[ChatMessage], message_dicts: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None, tool_choice: str = "auto", named_tool: str | None = None,
               add_generation_prompt: bool = True, chat_template: str | None = None,
               continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
               content_parts: bool = False, close_thinking: bool = False) -> ChatInput:
    return ChatInput(message_dicts, [text for m in messages for text in (m.role, m.text())], tools, tool_choice,
                     named_tool, add_generation_prompt, chat_template, continue_final_message, template_kwargs,
                     content_parts, close_thinking)


def tokenize_input(request: TokenizeRequest) -> tuple[str | ChatInput, bool]:
    """What a /tokenize request tokenizes (its prompt, or its chat as the template renders it), and whether
    special tokens are added."""
    if isinstance(request, TokenizeChatRequest):
        for i, message in enumerate(request.messages):
            if message.has_images:
                raise InvalidRequestError(f"messages[{i}].content", "/tokenize does not take image parts; an "
                                          "image's placeholder count comes from its pixels")
        request.check_continuation()
        return chat_input(request.messages, request.message_dicts(), request.tool_dicts() or None,
                          add_generation_prompt=request.add_generation_prompt is not False,
                          continue_final_message=bool(request.continue_final_message),
                          template_kwargs=request.chat_template_kwargs), request.add_special_tokens is True
    return request.prompt, request.add_special_tokens is not False


def _prompt_texts(prompt: str | ChatInput) -> tuple[str, list[str]]:
    """The request field a prompt came from, and its texts."""
    return ("messages", prompt.message_texts) if isinstance(prompt, ChatInput) else ("prompt", [prompt])


def check_tokenize_size(prompt: str | ChatInput, limit: int) -> None:
    """/tokenize's --max-tokenize-bytes: a prompt (or chat messages) of more UTF-8 text is a 400 naming it."""
    param, texts = _prompt_texts(prompt)
    if utf8_over(texts, limit):
        raise InvalidRequestError(param, f"{param} is {utf8_size(texts):,} bytes of UTF-8 text; /tokenize accepts "
                                  f"at most {limit:,}: send less, or start the server with a larger "
                                  "--max-tokenize-bytes")


class RequestBodyError(InvalidRequestError):
    """A raw request body that a worker found invalid, in the words FastAPI's validation gets."""


class UnservedModelError(Exception):
    """A raw /tokenize body names a model this server does not serve (the serving process words the 404)."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


def utf8_over(texts: Sequence[str], limit: int) -> bool:
    """Whether the texts together are more than `limit` bytes of UTF-8, encoding only where the character count
    cannot tell (a character is one to four bytes)."""
    chars = sum(len(text) for text in texts)
    if chars > limit:
        return True
    if chars * 4 <= limit or all(text.isascii() for text in texts):
        return False
    return utf8_size(texts) > limit


def utf8_size(texts: Sequence[str]) -> int:
    return sum(len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass")) for t in texts)


# ----- the work (module functions: a worker process runs them by name) -----------------------------------

def render_and_encode(tokenizer: Any, specials: Sequence[str], chat: ChatInput,
                      limit: int | None) -> tuple[ChatPrompt, int, list[int] | None]:
    prompt = render_chat(tokenizer, chat.messages, tools=chat.tools, tool_choice=chat.tool_choice,
                         named_tool=chat.named_tool, add_generation_prompt=chat.add_generation_prompt,
                         chat_template=chat.chat_template, continue_final_message=chat.continue_final_message,
                         template_kwargs=chat.template_kwargs, content_parts=chat.content_parts,
                         close_thinking=chat.close_thinking, tool_parser=chat.tool_parser,
                         exclude_tools_when_none=chat.exclude_tools_when_none, content_format=chat.content_format)
    return (prompt, *within_limit(encode_chat(tokenizer, prompt.text, chat.message_texts, specials), limit))


def tokenize_reply(tokenizer: Any, specials: Sequence[str], prompt: str | ChatInput, add_special_tokens: bool,
                   max_model_len: int, token_strs: bool = False) -> bytes:
    """The /tokenize response body; `token_strs`: each token's string too (vLLM's return_token_strs)."""
    if isinstance(prompt, ChatInput):
        ids = render_and_encode(tokenizer, specials, prompt, None)[2] or []
        if add_special_tokens:  # on top of the template's
            before, after = special_token_ends(tokenizer)
            ids = [*before, *ids, *after]
    else:
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if token_strs:
        reply["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return json.dumps(reply, separators=(",", ":")).encode()


def special_token_ends(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text it encodes with add_special_tokens (BOS, and
    EOS where its post-processor adds one): what encoding a text adds around its plain ids."""
    plain = tokenizer.encode("x", add_special_tokens=False)
    full = tokenizer.encode("x", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []


@functools.cache
def _adapter(schema: Any) -> TypeAdapter[Any]:
    return TypeAdapter(schema)


def parse_body(schema: Any, body: bytes) -> Any:
    """A JSON request body parsed and validated as FastAPI does it for a route whose body is `schema` (the same
    errors, in the same words); RequestBodyError when it is not a valid request."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        errors = [{"type": "json_invalid", "loc": ("body", error.pos), "msg": "JSON decode error",
                   "ctx": {"error": error.msg}}]
        raise RequestBodyError(*validation_error_info(errors)) from None
    except (UnicodeDecodeError, RecursionError) as error:
        raise RequestBodyError(None, f"the request body is not valid JSON: {error}") from None
    try:
        return _adapter(schema).validate_python(data)
    except ValidationError as error:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
        raise RequestBodyError(*validation_error_info(errors)) from None


def parse_request(tokenizer: Any, specials: Sequence[str], schema: Any, chunks: list[bytes]) -> Any:
    return parse_body(schema, b"".join(chunks))


def with_server_settings(chat: ChatInput, settings: dict[str, Any]) -> ChatInput:
    """The chat with the server's settings (`TextWorkers.chat_settings`): its template where the request brings
    none, its tool-call format and content format."""
    template = chat.chat_template if chat.chat_template is not None else settings["chat_template"]
    return dataclasses.replace(chat, **{**settings, "chat_template": template})


def tokenize_body(tokenizer: Any, specials: Sequence[str], chunks: list[bytes], model_names: tuple[str, ...],
                  chat_settings: dict[str, Any], max_bytes: int, max_model_len: int) -> bytes:
    """The /tokenize response body for a raw JSON request body (the chunks it came in)."""
    request: TokenizeRequest = parse_body(TokenizeRequest, b"".join(chunks))
    if request.model is not None and request.model not in model_names:
        raise UnservedModelError(request.model)
    prompt, add_special_tokens = tokenize_input(request)
    check_tokenize_size(prompt, max_bytes)
    if isinstance(prompt, ChatInput):
        prompt = with_server_settings(prompt, chat_settings)
    return tokenize_reply(tokenizer, specials, prompt, add_special_tokens, max_model_len,
                          bool(request.return_token_strs))


def detokenize_reply(tokenizer: Any, specials: Sequence[str], token_ids: list[int]) -> bytes:
    """The /detokenize response body."""
    return json.dumps({"prompt": tokenizer.decode(token_ids)}, ensure_ascii=False).encode()


# ----- worker processes (started, niced and tied to the serving process by the WorkerPool) ----------------


_worker_tokenizer: Any = None
_worker_specials: tuple[str, ...] = ()


def _init_worker(tokenizer_path: str, specials: tuple[str, ...], trust_remote_code: bool) -> None:
    global _worker_tokenizer, _worker_specials
    from kestrel.loader.tokenizer import load_tokenizer

    _worker_tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
    _worker_specials = specials


def _in_worker(work: Callable[..., Any], *args: Any) -> Any:
    return work(_worker_tokenizer, _worker_specials, *args)


def _in_worker_then_release(work: Callable[..., Any], *args: Any) -> Any:
    """A heavy job, after which the worker gives its freed heap back: a megabyte prompt's ids and encodings
    otherwise stay in its resident memory (~180 MB a worker, measured under `kestrel bench soak`)."""
    try:
        return _in_worker(work, *args)
    finally:
        release_memory()


class TextWorkers:
    def __init__(self, tokenizer: Any, specials: Sequence[str], *, tokenizer_path: str | None = None,
                 processes: int = 0, chat_template: str | None = None, tool_parser: str | None = None,
                 exclude_tools_when_none: bool = False, content_format: str = "auto",
                 trust_remote_code: bool = False, timeout: float | None = None,
                 max_tokenize_bytes: int | None = None) -> None:
        """`chat_template`, `tool_parser`, `exclude_tools_when_none`, `content_format`: the server's
        --chat-template text, --tool-call-parser, --exclude-tools-when-tool-choice-none and
        --chat-template-content-format, for every chat it renders; `timeout`: each request's tokenization deadline
        (s); `max_tokenize_bytes`: /tokenize's limit."""
        self.tokenizer = tokenizer
        self.chat_settings = {"chat_template": chat_template, "tool_parser": tool_parser,
                              "exclude_tools_when_none": exclude_tools_when_none, "content_format": content_format}
        self.specials = tuple(specials)
        self.processes = processes
        self.timeout = timeout
        self.max_tokenize_bytes = max_tokenize_bytes
        if processes > 0 and not tokenizer_path:
            raise ValueError("tokenizer worker processes need the tokenizer's directory")
        self.pool = WorkerPool(processes, _init_worker, (tokenizer_path, self.specials, trust_remote_code),
                               name="tokenizer", preload=tokenizer_modules(tokenizer_path) if processes else ())

    def start(self) -> TextWorkers:
        """Start every worker and load its tokenizer now, so the first requests do not wait for it."""
        self.pool.start()
        return self

    def close(self) -> None:
        self.pool.close()

    async def _run(self, param: str, heavy: bool, work: Callable[..., Any], *args: Any, doing: str = "") -> Any:
        """`work(tokenizer, specials, *args)` in a worker within the deadline; a timeout is the request's 400
        naming `param` (`doing`: what took too long, by default tokenizing it)."""
        if self.processes > 0:
            run_in_worker = _in_worker_then_release if heavy else _in_worker
            job: Awaitable[Any] = self.pool.run(run_in_worker, work, *args, timeout=self.timeout, heavy=heavy)
        else:
            job = self.pool.run(work, self.tokenizer, self.specials, *args, timeout=self.timeout, heavy=heavy)
        try:
            return await job
        except WorkTimeoutError as error:
            doing = doing or f"{'detokenizing' if param == 'tokens' else 'tokenizing'} {param}"
            raise InvalidRequestError(param, f"{doing} took longer than this server's limit of "
                                      f"{error.seconds:g} s; send less, or start the server with a larger "
                                      "--tokenize-timeout") from None

    async def encode_prompts(self, texts: list[str], limit: int | None, add_special_tokens: bool = True,
                             param: str = "prompt") -> list[tuple[int, list[int] | None]]:
        return list(await asyncio.gather(*(self._run(param, utf8_over([text], HEAVY_TEXT_BYTES), encode_prompt,
                                                     text, limit, add_special_tokens) for text in texts)))

    async def encode_pairs(self, pairs: list[tuple[str, str]], limit: int | None,
                           param: str) -> list[tuple[int, list[int] | None]]:
        return list(await asyncio.gather(*(self._run(param, utf8_over(pair, HEAVY_TEXT_BYTES), encode_pair, *pair,
                                                     limit) for pair in pairs)))

    async def render_chat(self, chat: ChatInput, limit: int | None) -> tuple[ChatPrompt, int, list[int] | None]:
        return await self._run("messages", utf8_over(chat.message_texts, HEAVY_TEXT_BYTES), render_and_encode,
                               with_server_settings(chat, self.chat_settings), limit)

    async def tokenize_reply(self, prompt: str | ChatInput, add_special_tokens: bool, max_model_len: int,
                             token_strs: bool = False) -> bytes:
        """The /tokenize reply for a parsed request: 400 beyond max_tokenize_bytes of prompt text."""
        if self.max_tokenize_bytes is not None:
            check_tokenize_size(prompt, self.max_tokenize_bytes)
        param, texts = _prompt_texts(prompt)
        if isinstance(prompt, ChatInput):
            prompt = with_server_settings(prompt, self.chat_settings)
        return await self._run(param, utf8_over(texts, HEAVY_TEXT_BYTES), tokenize_reply, prompt,
                               add_special_tokens, max_model_len, token_strs)

    async def tokenize_body(self, chunks: list[bytes], model_names: tuple[str, ...], max_model_len: int) -> bytes:
        """The /tokenize reply for a raw JSON body (its chunks, joined in the worker), parsed, validated and
        checked in the worker, a heavy job: RequestBodyError, UnservedModelError or the InvalidRequestError of a
        limit when it is refused."""
        limit = self.max_tokenize_bytes if self.max_tokenize_bytes is not None else sum(map(len, chunks))
        # Which field a deadline's error names, before anything parsed the body (a string's quotes are escaped).
        named = [field for field in (b'"messages"', b'"prompt"') if any(field in chunk for chunk in chunks)]
        param = "messages" if named == [b'"messages"'] else "prompt"
        return await self._run(param, True, tokenize_body, chunks, model_names, self.chat_settings, limit,
                               max_model_len)

    async def parse_body(self, schema: Any, chunks: list[bytes], param: str) -> Any:
        """A large JSON body (its chunks) parsed and validated in a worker, a heavy job, as FastAPI would:
        RequestBodyError when it is not a valid request; a deadline's 400 names `param`."""
        return await self._run(param, True, parse_request, schema, chunks, doing="parsing the request body")

    async def detokenize_reply(self, token_ids: list[int]) -> bytes:
        return await self._run("tokens", len(token_ids) > HEAVY_TOKEN_IDS, detokenize_reply, token_ids)
