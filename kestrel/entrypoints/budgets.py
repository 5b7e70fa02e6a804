"""Per-request budgets of the OpenAI server: how many bytes one response may carry (--max-response-bytes), and how
many stop strings and bad words one request may give, and how long each may be.

The response's size is estimated before admission from the fields that multiply it (n, max_tokens, logprobs /
top_logprobs, prompt_logprobs, echo, return_token_ids) and, where that bound is only the model's context, counted
while the response is produced (`ResponseBudget`): a stream ends with an error event, a whole response is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kestrel.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from kestrel.outputs import RequestOutput
from kestrel.request import InvalidRequestError

# Longest stop string and bad word, in characters: each is searched for in every decoded step (stop strings hold
# back that much streamed text), or tokenized into a banned sequence (bad words).
MAX_STOP_STRING_CHARS = 1024
MAX_BAD_WORD_CHARS = 1024


@dataclass(frozen=True)
class EntryBytes:
    """Bytes of JSON that one response format spends per generated token on logprobs."""

    token: int  # the chosen token's entry (logprobs asked for, no top candidates)
    top: int  # each top candidate beyond it


# Measured on kestrel-tiny and the random test checkpoint (64 tokens, n = 1 and 4, body bytes per token, with
# framing): chat 98-103 with logprobs and top_logprobs 0, 160-169 with 1, 427-440 with 5, 1,436-1,521 with 20;
# completions 64-68 with logprobs 0, 90-92 with 1, 172-186 with 5, 526-581 with 20; text alone 7-9; prompt_logprobs
# 67-72 per entry. The estimates round those up, so they bound what was seen.
TEXT_BYTES_PER_TOKEN = 8
RESPONSE_FRAMING_BYTES = 1024  # a whole body's id, model, usage and the like
CHOICE_FRAMING_BYTES = 256  # each choice's index, role, finish_reason and the like
TOKEN_ID_BYTES = 8  # return_token_ids: one id and its comma
TOKEN_ID_FLOOR = 2  # a one-digit id and its comma
PROMPT_LOGPROB_ENTRY_BYTES = 80  # {"id": {"logprob", "rank", "decoded_token"}}
CHAT_ENTRY_BYTES = EntryBytes(token=120, top=80)  # {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}
COMPLETION_ENTRY_BYTES = EntryBytes(token=80, top=30)  # tokens, token_logprobs, text_offset, top_logprobs {token: lp}
# The least JSON an entry can take (an empty token, logprob 0.0): what a whole response is charged while its tokens
# arrive, so that it is only ended early when its body would surely pass the budget.
CHAT_ENTRY_FLOOR = EntryBytes(token=55, top=37)  # {"token":"","logprob":0.0,"bytes":[],"top_logprobs":[]}
COMPLETION_ENTRY_FLOOR = EntryBytes(token=8, top=6)  # "", 0.0, 0 and {} / "":0.0


class ResponseTooLargeError(InvalidRequestError):
    """The response would pass, or passed, --max-response-bytes."""

    code = "response_too_large"


@dataclass(frozen=True)
class ResponseShape:
    """What one request's response carries beyond its text, and the request fields that set it (for errors)."""

    chat: bool
    n: int
    logprobs: int | None  # top candidates per generated token; None: no logprobs
    prompt_logprobs: int | None  # the response's prompt_logprobs field
    echo_bytes: Sequence[int] = ()  # per prompt: the echoed text's bytes, in each of the n choices
    echo_logprobs: bool = False  # completions' echo with logprobs: the prompt's tokens carry logprobs too
    token_ids: bool = False  # return_token_ids
    max_tokens_param: str = "max_tokens"
    logprobs_param: str = "logprobs"

    @property
    def entry_bytes(self) -> EntryBytes:
        return CHAT_ENTRY_BYTES if self.chat else COMPLETION_ENTRY_BYTES

    def token_bytes(self, entries: EntryBytes, text_bytes: int, id_bytes: int) -> int:
        """The bytes one generated token adds to the response."""
        size = text_bytes + (id_bytes if self.token_ids else 0)
        if self.logprobs is not None:
            size += entries.token + self.logprobs * entries.top
        return size

    def fixed_bytes(self, prompt_lengths: Sequence[int]) -> int:
        """The bytes that do not grow with the generated tokens: the body's framing and what the prompts put in
        it (echoed text and its logprobs, prompt_logprobs, prompt token ids)."""
        # Completions repeat the prompt's part in each of its n choices; chat has it once.
        copies = 1 if self.chat else self.n
        size = RESPONSE_FRAMING_BYTES + self.n * len(prompt_lengths) * CHOICE_FRAMING_BYTES
        for i, length in enumerate(prompt_lengths):
            echoed = self.echo_bytes[i] if i < len(self.echo_bytes) else 0
            size += self.n * echoed
            if self.echo_logprobs:
                size += self.n * length * (self.entry_bytes.token + (self.logprobs or 0) * self.entry_bytes.top)
            if self.prompt_logprobs is not None:
                size += copies * length * (self.prompt_logprobs + 1) * PROMPT_LOGPROB_ENTRY_BYTES
            if self.token_ids:
                size += copies * length * TOKEN_ID_BYTES
        return size

    def drivers(self) -> str:
        """The request fields that make the response large, as the errors name them."""
        if self.logprobs is None:
            return f"n or {self.max_tokens_param}"
        return f"n, {self.max_tokens_param} or {self.logprobs_param}"

    def prompt_param(self) -> str:
        """The request field behind most of the prompts' part of the response."""
        if self.prompt_logprobs is not None:
            return "prompt_logprobs"
        if self.echo_logprobs or any(self.echo_bytes):
            return "echo"
        return "return_token_ids" if self.token_ids else "n"


@dataclass(frozen=True)
class ResponseEstimate:
    fixed_bytes: int
    generated_tokens: int  # all choices together
    token_bytes: int
    max_tokens: int | None  # None: the generated tokens are bounded only by the context

    @property
    def generated_bytes(self) -> int:
        return self.generated_tokens * self.token_bytes

    @property
    def total(self) -> int:
        return self.fixed_bytes + self.generated_bytes


def estimate(shape: ResponseShape, prompt_lengths: Sequence[int], max_tokens: int | None,
             context: int) -> ResponseEstimate:
    """An upper estimate of the response's bytes: n x max_tokens (else the context left after each prompt) x the
    bytes a token takes with the asked-for logprobs, plus the framing and the prompts' part."""
    generated = sum(shape.n * max(max_tokens if max_tokens is not None else context - length, 0)
                    for length in prompt_lengths)
    return ResponseEstimate(shape.fixed_bytes(prompt_lengths), generated,
                            shape.token_bytes(shape.entry_bytes, TEXT_BYTES_PER_TOKEN, TOKEN_ID_BYTES), max_tokens)


def check_estimate(shape: ResponseShape, found: ResponseEstimate, limit: int, num_prompts: int = 1) -> None:
    """Refuse, before any work, a response whose estimate passes `limit`. A plain response (no logprobs) whose
    tokens only the context bounds is admitted: it is counted while produced instead (ResponseBudget)."""
    counted = found.fixed_bytes
    if found.max_tokens is not None or shape.logprobs is not None:
        counted += found.generated_bytes
    if counted <= limit:
        return
    if found.fixed_bytes > found.generated_bytes:
        param = shape.prompt_param()
        reason = f"{found.fixed_bytes:,} bytes before any generated token ({param}, n={shape.n})"
    else:
        param = shape.logprobs_param if shape.logprobs is not None else shape.max_tokens_param
        prompts = f"{num_prompts} prompts x " if num_prompts > 1 else ""
        each = (f"{shape.max_tokens_param}={found.max_tokens}" if found.max_tokens is not None else
                f"the context left ({shape.max_tokens_param} not given)")
        with_logprobs = f" with {shape.logprobs_param}={shape.logprobs}" if shape.logprobs is not None else ""
        reason = (f"{prompts}n={shape.n} x {each} = {found.generated_tokens:,} tokens x ~{found.token_bytes:,} "
                  f"bytes a token{with_logprobs}")
    raise ResponseTooLargeError(param, f"the response could reach ~{counted:,} bytes: {reason}; that is more than "
                                f"this server's limit of {limit:,} bytes (--max-response-bytes): lower "
                                f"{shape.drivers()}, or start the server with a larger --max-response-bytes")


class ResponseBudget:
    """Counts the bytes one response produces, all its choices together; past `limit` the response ends with a
    ResponseTooLargeError. Streams are charged each event less the framing every event repeats (id, model,
    created), so that a response counts about the same streamed or whole."""

    def __init__(self, limit: int, shape: ResponseShape) -> None:
        self.limit = limit
        self.shape = shape
        self.used = 0
        self.framing = 0
        floor = CHAT_ENTRY_FLOOR if shape.chat else COMPLETION_ENTRY_FLOOR
        self._token_floor = shape.token_bytes(floor, 0, TOKEN_ID_FLOOR)

    def charge(self, size: int) -> None:
        self.used += size
        if self.used > self.limit:
            raise ResponseTooLargeError(self.shape.max_tokens_param, (
                f"the response passed this server's limit of {self.limit:,} bytes (--max-response-bytes) and was "
                f"ended; lower {self.shape.drivers()}, or start the server with a larger --max-response-bytes"))

    def event(self, event: str) -> str:
        """A streamed event, charged."""
        self.charge(max(len(event.encode()) - self.framing, 0))
        return event

    def output(self, output: RequestOutput) -> None:
        """A whole response's new tokens, charged the least bytes they can take in its body."""
        for c in output.outputs:
            self.charge(len(c.delta_text.encode()) + len(c.delta_token_ids) * self._token_floor)

    def body(self, body: bytes | memoryview) -> None:
        """A whole response's body, charged in full (what its tokens were charged is replaced)."""
        self.used = 0
        self.charge(len(body))


def check_stop_and_bad_words(request: CompletionRequest | ChatCompletionRequest, max_stop_sequences: int,
                              max_bad_words: int) -> None:
    """stop and stop_token_ids each hold at most --max-stop-sequences entries, bad_words at most --max-bad-words;
    a stop string or bad word is at most MAX_STOP_STRING_CHARS / MAX_BAD_WORD_CHARS characters."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    lists = (("stop", "stop strings", stop, max_stop_sequences, "--max-stop-sequences", MAX_STOP_STRING_CHARS),
             ("stop_token_ids", "stop token ids", request.stop_token_ids or [], max_stop_sequences,
              "--max-stop-sequences", None),
             ("bad_words", "bad words", request.bad_words or [], max_bad_words, "--max-bad-words",
              MAX_BAD_WORD_CHARS))
    one = {"stop": "a stop string", "bad_words": "a bad word"}
    for param, what, items, limit, flag, max_chars in lists:
        if len(items) > limit:
            raise InvalidRequestError(param, f"{param} gives {len(items):,} {what}, more than this server's limit "
                                      f"of {limit} ({flag}); give at most {limit}")
        for i, item in enumerate(items if max_chars is not None else ()):
            if len(item) > max_chars:
                where = param if isinstance(request.stop, str) and param == "stop" else f"{param}[{i}]"
                raise InvalidRequestError(where, f"{where} is {len(item):,} characters long, more than the "
                                          f"{max_chars:,} characters {one[param]} may have on this server")
