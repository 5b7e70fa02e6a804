"""Incremental detokenization with stop strings (pure Python; the tokenizer is passed in).

Text grows by decoding a short window of tokens instead of the whole output each step: the
window starts at `prefix_offset` and `read_offset` marks where the already-committed text ends.
Decoding window[prefix:] and window[prefix:read] and taking the difference gives the new text
with the context a decoder needs (byte-level merges, SentencePiece leading spaces) and costs
O(window) per step. If the new piece ends with U+FFFD, a multi-byte character is still split
across tokens: the piece stays pending (visible in `output_text`, held back from `get_delta`)
and the offsets stay put until a later token completes it.

The tokenizer is duck-typed as a Hugging Face tokenizer: `convert_ids_to_tokens`,
`convert_tokens_to_string`, `decode` and `all_special_ids`. `TokenizerLookups` holds what the detokenizers of
one tokenizer share: each id's token string and each token's text decoded alone, both pure functions of their
key, so every step costs one tokenizer call per sequence instead of three.

For a Hugging Face fast tokenizer with a byte-level decoder the same window runs inside the `tokenizers` library
(its `DecodeStream`: one call per token, no token strings in Python), except where special tokens split the text
into separately decoded runs. The ids since its last piece are mirrored here, so that a character still split
across tokens shows in the text as the window decodes it (decoded here only while one is split).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from kestrel.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5
_FAST_TOKENIZER_MODULE = "transformers.tokenization_utils_tokenizers"


def _fast_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` of a Hugging Face fast tokenizer that does not override
    `convert_tokens_to_string` (so decoding it is decoding the backend), when it has a decoder."""
    method = getattr(type(tokenizer), "convert_tokens_to_string", None)
    if getattr(method, "__module__", None) == _FAST_TOKENIZER_MODULE:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(backend, "decoder", None) is not None:
            return backend
    return None


def _byte_level(backend: Any) -> bool:
    """Whether `backend` decodes byte-level tokens (GPT-2's scheme: Llama 3, Qwen, ...). Its text is the lossy UTF-8
    of the tokens' bytes, so a window's text always starts with its last piece's and `DecodeStream` gives the
    Python window's text at every step, invalid bytes included; other decoders (SentencePiece's byte fallback,
    with its space stripping) keep the Python window, whose text for invalid bytes `DecodeStream` does not match."""
    return type(backend.decoder).__name__ == "ByteLevel"


def _decode_stream_type(backend: Any) -> type | None:
    """The `DecodeStream` of the library that made `backend`, read from its decoders' module, which is loaded
    already (the engine imports only the standard library), where it takes prompt ids (tokenizers 0.21+)."""
    module = sys.modules.get(type(backend.decoder).__module__)
    stream_type = getattr(module, "DecodeStream", None)
    if stream_type is None:
        return None
    try:
        stream_type(ids=[], skip_special_tokens=False)
    except TypeError:
        return None
    return stream_type


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable Latin-1 bytes stand for themselves and the
    other 68 bytes, in order, for U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + len(chars) - len(printable))
    return {char: byte for byte, char in chars.items()}


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def _byte_fallback(token: str) -> int | None:
    """The byte a SentencePiece byte-fallback token ("<0xE2>") stands for, else None."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


class TokenizerLookups:
    """Per-tokenizer caches shared by all its detokenizers (bounded by the vocabulary). They assume the
    tokenizer's vocabulary and special tokens no longer change."""

    _shared: weakref.WeakKeyDictionary[Any, TokenizerLookups] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerLookups:
        """The lookups of `tokenizer`, kept warm for as long as it lives (across engines that share it)."""
        try:
            lookups = cls._shared.get(tokenizer)
        except TypeError:  # neither hashable nor weakly referable: not shared
            return cls(tokenizer)
        if lookups is None:
            # A registry entry must not keep its own key alive.
            lookups = cls._shared[tokenizer] = cls(tokenizer, weakref.ref(tokenizer))
        return lookups

    def __init__(self, tokenizer: Any, tokenizer_ref: Callable[[], Any] | None = None) -> None:
        """`tokenizer_ref`: how to reach the tokenizer later (a strong reference when not given)."""
        self._tokenizer_ref = tokenizer_ref if tokenizer_ref is not None else lambda: tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)
        backend = _fast_backend(tokenizer)
        self.tokens_to_string: Callable[[list[str]], str] = (
            backend.decoder.decode if backend is not None else self._tokens_to_string)
        # The Rust window of a fast tokenizer (None: the window runs here).
        self.stream_backend = backend
        self.decode_stream = _decode_stream_type(backend) if backend is not None and _byte_level(backend) else None
        self._byte_level = backend is not None and _byte_level(backend)
        self._token_strings: dict[int, str] = {}
        self._single_texts: dict[str, str] = {}
        self._token_bytes: dict[int, bytes] = {}

    def _tokens_to_string(self, tokens: list[str]) -> str:
        return self._tokenizer_ref().convert_tokens_to_string(tokens)

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        cache = self._token_strings
        if len(ids) == 1:  # one token per sequence per step is the common case
            token = cache.get(ids[0])
            if token is not None:
                return [token]
            tokens = self._known_tokens(ids)
            cache[ids[0]] = tokens[0]
            return tokens
        missing = [i for i in ids if i not in cache]
        if missing:
            missing = list(dict.fromkeys(missing))
            cache.update(zip(missing, self._known_tokens(missing)))
        return [cache[i] for i in ids]

    def _known_tokens(self, ids: list[int]) -> list[str]:
        """The token strings of `ids`; "" for an id past the tokenizer's vocabulary, which a model whose
        embedding is padded beyond it (a vocab_size rounded up) can sample: it decodes to no text."""
        return [token or "" for token in self._tokenizer_ref().convert_ids_to_tokens(ids)]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a logprob's `bytes`, which rebuild a character split across tokens): a
        byte-level token's own bytes, a byte-fallback token's byte, a SentencePiece piece with its spaces, else
        its text decoded alone, in UTF-8."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._bytes_of(token_id)
        return cached

    def _bytes_of(self, token_id: int) -> bytes:
        (token,) = self.ids_to_tokens([token_id])
        if token and token_id not in self.special_ids:
            if self._byte_level:
                raw = [_BYTE_LEVEL_ALPHABET.get(char) for char in token]
                if None not in raw:  # an added token outside the alphabet is plain text
                    return bytes(raw)  # type: ignore[arg-type]
            else:
                byte = _byte_fallback(token)
                if byte is not None:
                    return bytes([byte])
                if "\u2581" in token:  # SentencePiece's word boundary, which decoding a token alone strips
                    return token.replace("\u2581", " ").encode()
        return self.decode_tokens([token]).encode()

    def decode_tokens(self, tokens: list[str]) -> str:
        if len(tokens) != 1:
            return self.tokens_to_string(tokens)
        token = tokens[0]
        text = self._single_texts.get(token)
        if text is None:
            text = self._single_texts[token] = self.tokens_to_string(tokens)
        return text


class IncrementalDetokenizer:
    """Output text of one sequence, extended token by token, stopped at the first stop string."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 lookups: TokenizerLookups | None = None) -> None:
        """`lookups`: shared with the other detokenizers of `tokenizer` (a private one when not given)."""
        self._lookups = lookups = lookups if lookups is not None else TokenizerLookups(tokenizer)
        self._params = params
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self._special_ids = lookups.special_ids
        self._skip_special = params.skip_special_tokens
        # Without spaces between special tokens, each special token is a literal boundary between
        # separately decoded runs (Hugging Face's slow-tokenizer rule); with them, the tokenizer's own
        # decoding of the whole sequence is kept.
        self._split_at_special = not params.skip_special_tokens and not params.spaces_between_special_tokens
        self._tokens: list[str] = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._stream: Any = None
        if lookups.decode_stream is not None and not self._split_at_special:
            # The window in the tokenizers library: `_piece_ids` mirror its last piece's ids (the context of the
            # next one) and `_unread_ids` those it has not turned into text yet.
            self._piece_ids = self._context_ids
            self._unread_ids: list[int] = []
            self._stream = lookups.decode_stream(ids=self._piece_ids, skip_special_tokens=False)
            self._stream_step = functools.partial(self._stream.step, lookups.stream_backend)
        self._committed = ""
        self._pending = ""
        self._stops = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._searched = 0  # stable characters already searched for stop strings
        self._emitted = 0
        self.stop_reason: str | None = None
        self._final_text: str | None = None

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[str]:
        """The prompt's last few tokens, decoded before the output so that a decoder that drops a
        leading space at the start of a text (SentencePiece) keeps the output's first space.
        Byte-level tokenizers decode the same either way."""
        self._context_ids: list[int] = []
        ids = [t for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:] if t not in self._special_ids]
        if not ids:
            return []
        tokens = self._lookups.ids_to_tokens(ids)
        # A prompt ending inside a multi-byte character would shift every later offset.
        if self._lookups.decode_tokens(tokens).endswith(_REPLACEMENT):
            return []
        self._context_ids = ids
        return tokens

    @property
    def output_text(self) -> str:
        if self._final_text is not None:
            return self._final_text
        return self._committed + self._pending

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int], stop_token: bool = False) -> str | None:
        """Append tokens; return the stop string if one now matches (text is then final). `stop_token`: the last
        of them ended the sequence (an EOS or stop token id); its text is left out unless include_stop_str_in_output
        asks for it, as the text of a stop string is."""
        if self.stop_reason is not None:
            raise RuntimeError("update() after a stop string matched")
        if stop_token and new_token_ids and not self._params.include_stop_str_in_output:
            stop_string = self.update(new_token_ids[:-1])
            self.token_ids.append(new_token_ids[-1])  # the sequence's token, without its text
            return stop_string
        short = self._params.min_tokens - len(self.token_ids)
        if short > 0:
            # Stop strings wait for min_tokens as EOS does: a match ending in the text of the first min_tokens
            # tokens never counts, however many tokens a step brings.
            head, new_token_ids = new_token_ids[:short], new_token_ids[short:]
            self.token_ids.extend(head)
            self._append_tokens(head)
            self._searched = self._stable_len()
            if not new_token_ids:
                return None
        self.token_ids.extend(new_token_ids)
        self._append_tokens(new_token_ids)
        return self._check_stop()

    def text_and_delta(self, finished: bool) -> tuple[str, str]:
        """A cumulative output's (text, delta_text): the delta as `get_delta` gives it, and the text given so far,
        which only ever grows (unlike `output_text`, where a possible stop string's start shows until the match
        takes it back, and a split character shows as U+FFFD until it completes)."""
        delta = self.get_delta(finished)
        return self.output_text[:self._emitted], delta

    def get_delta(self, finished: bool) -> str:
        """Text not yet returned, holding back a possible stop-string prefix and split characters."""
        emitted = self._emitted
        if self._final_text is not None:
            delta = self._final_text[emitted:]
            self._emitted += len(delta)
            return delta
        if finished:
            limit = len(self._committed) + len(self._pending)
        else:
            limit = self._stable_len() - max(self._max_stop_len - 1, 0)
        if limit <= emitted:
            return ""
        delta = self._text_between(emitted, limit)
        self._emitted = limit
        return delta

    def _append_tokens(self, token_ids: list[int]) -> None:
        special_ids = self._special_ids
        no_special = special_ids.isdisjoint(token_ids)
        kept = token_ids if no_special or not self._skip_special else [t for t in token_ids if t not in special_ids]
        if not kept:
            return
        if self._stream is not None:
            self._stream_tokens(kept)
            return
        tokens = self._lookups.ids_to_tokens(kept)
        if no_special or not self._split_at_special:
            self._tokens.extend(tokens)
            self._decode_window()
            return
        for token_id, token in zip(kept, tokens):
            if token_id in self._special_ids:
                self._append_literal(token)
            else:
                self._tokens.append(token)
        self._decode_window()

    def _append_literal(self, token: str) -> None:
        """A special token ends the current run: finalize it as is and restart the window after it."""
        self._decode_window()
        self._commit(self._pending + token)
        self._pending = ""
        self._prefix_offset = self._read_offset = len(self._tokens)

    def _stream_tokens(self, token_ids: list[int]) -> None:
        step, unread = self._stream_step, self._unread_ids
        for i, token_id in enumerate(token_ids):
            # An id the vocabulary lacks (past it: a padded embedding; or a gap in its ids) decodes to no text in
            # the library's window, as in the Python one.
            try:
                piece = step(token_id)
            except Exception:  # noqa: BLE001 - the library's only error type; its window refused this text
                self._leave_stream(token_ids[i:])
                return
            unread.append(token_id)
            if piece is not None:
                self._commit(piece)
                self._piece_ids, self._unread_ids = unread, []
                unread = self._unread_ids
        self._pending = self._pending_piece() if unread else ""

    def _leave_stream(self, rest: list[int]) -> None:
        """Go on in the Python window from the stream's state, should `DecodeStream` refuse a token (it raises
        where a window's text stops starting with its last piece's, which a byte-level decoder never does; the
        Python window takes any text as it comes)."""
        self._stream = None
        self._tokens = self._lookups.ids_to_tokens(self._piece_ids + self._unread_ids + rest)
        self._prefix_offset, self._read_offset = 0, len(self._piece_ids)
        self._decode_window()

    def _pending_piece(self) -> str:
        """The text of the ids the stream holds back (a character still split across tokens), as the window
        decodes it: shown in `output_text`, held back from deltas until complete."""
        lookups = self._lookups
        context = lookups.ids_to_tokens(self._piece_ids) if self._piece_ids else []
        window = context + lookups.ids_to_tokens(self._unread_ids)
        return lookups.decode_tokens(window)[len(lookups.decode_tokens(context)) if context else 0:]

    def _decode_window(self) -> None:
        decode = self._lookups.decode_tokens
        window = self._tokens[self._prefix_offset :]
        prefix_text = decode(window[: self._read_offset - self._prefix_offset]) if window else ""
        new_text = decode(window) if window else ""
        piece = new_text[len(prefix_text) :]
        if piece.endswith(_REPLACEMENT):
            self._pending = piece
            return
        self._commit(piece)
        self._pending = ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)

    def _stable_len(self) -> int:
        """Characters that no later token can change (all but a trailing split character)."""
        return len(self._committed) + len(self._pending.rstrip(_REPLACEMENT))

    def _text_between(self, start: int, end: int | None = None) -> str:
        """`output_text[start:end]` before any stop string, sliced from the committed and the pending text apart: a
        step copies the text it reads, not the whole text."""
        committed, pending = self._committed, self._pending
        n = len(committed)
        if end is not None and end <= n:
            return committed[start:end]
        pending_end = None if end is None else end - n
        if start >= n:
            return pending[start - n:pending_end]
        return committed[start:] + pending[:pending_end]

    def _commit(self, piece: str) -> None:
        # The text is taken out of the attribute while it grows: a string held only by a local variable is
        # extended in place (amortized O(piece)), where `self._committed += piece` copies the whole text each time.
        committed = self._committed
        self._committed = ""
        committed += piece
        self._committed = committed

    def _check_stop(self) -> str | None:
        if not self._stops:
            return None
        # A match not seen before must end after the previously searched stable text: only the text from there on
        # is searched (a copy of it, not of the whole text).
        start = max(0, self._searched - self._max_stop_len + 1)
        tail = self._text_between(start)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = tail.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        self._searched = self._stable_len()
        if best is None:
            return None
        index, stop = best
        end = start + index + (len(stop) if self._params.include_stop_str_in_output else 0)
        self._final_text = self.output_text[:end]
        self.stop_reason = stop
        return stop
