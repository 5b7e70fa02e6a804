"""Prompt compression: a small causal LM (the compressor, `--prompt-compressor`) scores every token of a prompt by
its surprisal given the text before it, and `compression_plan` drops the least informative ones down to the
request's rate, keeping verbatim what must stay (docs/long-context.md, "Prompt compression").

The compressor is a second model loaded by the same loader, on the served engine's device, with a KV cache of
`batch` windows; no scheduler runs it: `worker.prompt_scoring` prefills up to `batch` windows in one forward and
brings back one float per scored token. A prompt longer than its window is scored in overlapping windows (each
token once, after the first window with at least half a window of context). Prompts are compressed one at a time
(a lock), so the batches, and so every score, depend on the prompt alone: the same prompt and rate give the same
compressed prompt.

The compressor's tokenizer need not be the served model's: tokens are scored on the compressor's tokens, the kept
ones are mapped back to the prompt's characters (their offsets), and the served model tokenizes the kept text
afresh. A kept piece may so tokenize differently at its edges than inside the whole prompt.

The server runs the compression in one worker thread (`compress_*_async`), off the event loop and outside the
engine thread, before the request enters the scheduler: other requests' steps never wait for it.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel.config import PromptCompressorConfig
from kestrel.entrypoints.compression_plan import (
    KeepMarkerError,
    ScoredTokens,
    Span,
    code_block_spans,
    literal_spans,
    select,
    strip_keep_markers,
    text_of,
)
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import PromptCompression

PARAM = "prompt_compression"
SYSTEM_ROLES = ("system", "developer")
MESSAGE_SEPARATOR = "\n\n"  # between messages' texts when a chat is scored as one text
TOKENIZE_PIECE_CHARS = 4096  # a long prompt is tokenized in pieces of about this many characters, in parallel


@dataclass(frozen=True)
class CompressedPrompt:
    """A compressed text prompt (`text`) or chat (`messages`), and what the compressor counted: its tokens before
    and after, and the seconds compression took."""

    text: str | None
    messages: list[dict[str, Any]] | None
    compressor_tokens: int
    kept_compressor_tokens: int
    seconds: float


@dataclass(frozen=True)
class _Window:
    begin: int
    end: int
    score_from: int  # the first position of [begin, end) scored here


class PromptCompressor:
    """The compressor model and its engine core. `device`, `dtype`, `cpu_threads`: the served engine's."""

    def __init__(self, config: PromptCompressorConfig, device: str = "auto", dtype: str = "auto",
                 cpu_threads: int | None = None) -> None:
        from kestrel.entrypoints.engine_factory import engine_config
        from kestrel.worker.model_runner import ModelRunner

        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        if not getattr(self.tokenizer, "is_fast", False):
            raise InvalidRequestError("prompt_compressor", f"the compressor's tokenizer in {config.model} is not a "
                                      "fast tokenizer, which character offsets need")
        blocks_per_window = -(-config.window // 16)
        self.engine_config = engine_config(
            config.model, device=device, dtype=dtype, cpu_threads=cpu_threads, max_model_len=config.window,
            max_num_seqs=config.batch, max_num_batched_tokens=config.window * config.batch,
            kv_cache_blocks=blocks_per_window * config.batch + 1, enable_prefix_caching=False, enforce_eager=True,
            async_scheduling=False, disable_log_stats=True)
        eos = self.tokenizer.eos_token_id
        self.runner = ModelRunner(self.engine_config, eos_token_id=eos)
        start = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else eos
        self._start_token = [int(start)] if start is not None else []
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kestrel-compressor")

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ----- scoring -------------------------------------------------------------------------------------

    def score(self, text: str) -> ScoredTokens:
        """Each compressor token of `text` (tokens sharing characters merged) and its surprisal in nats. The text
        is tokenized in pieces cut at line ends (`line_pieces`), which the tokenizer's batch call runs in
        parallel: no token spans a cut, and the cuts depend on the text alone."""
        pieces = line_pieces(text, TOKENIZE_PIECE_CHARS)
        encoding = self.tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True)
        ids = [token for piece_ids in encoding["input_ids"] for token in piece_ids]
        if not ids:
            return ScoredTokens.of([])
        starts = np.cumsum([0, *(len(piece) for piece in pieces[:-1])])
        offsets = np.concatenate([np.asarray(piece_offsets, dtype=np.int64).reshape(-1, 2) + start
                                  for piece_offsets, start in zip(encoding["offset_mapping"], starts)])
        return ScoredTokens.merged(offsets[:, 0], offsets[:, 1], self._surprisal(ids))

    def _surprisal(self, ids: list[int]) -> list[float]:
        """-ln p(token | the tokens before it), `batch` windows per forward; the first token is scored after the
        start token (inf without one)."""
        from kestrel.worker.prompt_scoring import token_surprisal

        sequence = self._start_token + ids
        windows = _windows(len(sequence), self.config.window - 1)
        values = [math.inf] * len(sequence)
        with self._lock:
            for first in range(0, len(windows), self.config.batch):
                batch = windows[first: first + self.config.batch]
                scored = token_surprisal(self.runner, [sequence[w.begin: w.end] for w in batch],
                                         [w.score_from - w.begin for w in batch])
                for window, window_values in zip(batch, scored):
                    values[window.score_from: window.end] = window_values
        return values[len(self._start_token):]

    # ----- compression ---------------------------------------------------------------------------------

    def compress_text(self, text: str, options: PromptCompression,
                      special_texts: Sequence[str] = ()) -> CompressedPrompt:
        """A text prompt compressed: `special_texts` (the served tokenizer's special tokens) stay wherever they
        occur, so do `keep_spans`, marked spans and, when asked, code blocks."""
        started = time.perf_counter()
        for name in ("keep_system", "keep_last_user_turn"):
            if getattr(options, name) is not None:
                raise InvalidRequestError(f"{PARAM}.{name}", f"{PARAM}.{name} applies to chat messages; a text "
                                          "prompt has no roles: mark what must stay with keep_spans or the keep "
                                          "markers")
        stripped, protected, offset_map = _stripped(text, PARAM)
        for start, end in options.keep_spans:
            if end > len(text):
                raise InvalidRequestError(f"{PARAM}.keep_spans", f"{PARAM}.keep_spans has [{start}, {end}], past "
                                          f"the prompt's {len(text)} characters")
            protected.append((offset_map[start], offset_map[end]))
        protected.extend(literal_spans(stripped, special_texts))
        if options.keep_code_blocks:
            protected.extend(code_block_spans(stripped))
        kept_text, total, kept = self._compressed(stripped, protected, options.rate)
        return CompressedPrompt(kept_text, None, total, kept, time.perf_counter() - started)

    def compress_messages(self, messages: Sequence[dict[str, Any]], options: PromptCompression) -> CompressedPrompt:
        """A chat compressed message by message, scored as one text (each message's text in order, so every
        message is scored in the context of the ones before it); the template's own text is not touched, as the
        chat is rendered from the compressed messages."""
        started = time.perf_counter()
        if options.keep_spans:
            raise InvalidRequestError(f"{PARAM}.keep_spans", f"{PARAM}.keep_spans indexes a text prompt's "
                                      "characters; in chat messages mark what must stay with the keep markers")
        keep_system = options.keep_system is not False
        keep_last_user = options.keep_last_user_turn is not False
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        pieces: list[str] = []
        regions: dict[int, tuple[int, int]] = {}
        protected: list[Span] = []
        position = 0
        for i, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, str) or not content:
                continue  # content parts and tool calls are kept as they are
            stripped, marked, _ = _stripped(content, f"messages[{i}].content")
            if pieces:
                pieces.append(MESSAGE_SEPARATOR)
                protected.append((position, position + len(MESSAGE_SEPARATOR)))
                position += len(MESSAGE_SEPARATOR)
            pieces.append(stripped)
            regions[i] = (position, position + len(stripped))
            verbatim = ((keep_system and message.get("role") in SYSTEM_ROLES)
                        or (keep_last_user and i == last_user))
            if verbatim:
                protected.append(regions[i])
            protected.extend((position + a, position + b) for a, b in marked)
            if options.keep_code_blocks:
                protected.extend((position + a, position + b) for a, b in code_block_spans(stripped))
            position += len(stripped)
        text = "".join(pieces)
        tokens = self.score(text) if options.rate < 1.0 and text else []
        selection = select(text, tokens, options.rate, protected) if tokens else None
        out = []
        for i, message in enumerate(messages):
            if i not in regions:
                out.append(dict(message))
                continue
            region = regions[i]
            kept = text[region[0]: region[1]] if selection is None else text_of(text, selection.kept_spans, region)
            out.append({**message, "content": kept})
        total = selection.num_tokens if selection else len(tokens)
        kept_count = selection.num_kept if selection else len(tokens)
        return CompressedPrompt(None, out, total, kept_count, time.perf_counter() - started)

    def _compressed(self, text: str, protected: list[Span], rate: float) -> tuple[str, int, int]:
        if rate >= 1.0 or not text:
            return text, 0, 0
        tokens = self.score(text)
        if not tokens:
            return text, 0, 0
        selection = select(text, tokens, rate, protected)
        return text_of(text, selection.kept_spans), selection.num_tokens, selection.num_kept

    # ----- off the event loop ----------------------------------------------------------------------------

    async def compress_text_async(self, text: str, options: PromptCompression,
                                  special_texts: Sequence[str] = ()) -> CompressedPrompt:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.compress_text, text, options,
                                                                tuple(special_texts))

    async def compress_messages_async(self, messages: Sequence[dict[str, Any]],
                                      options: PromptCompression) -> CompressedPrompt:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.compress_messages,
                                                                list(messages), options)


def _stripped(text: str, param: str) -> tuple[str, list[Span], list[int]]:
    try:
        return strip_keep_markers(text)
    except KeepMarkerError as error:
        raise InvalidRequestError(param, f"{param}: {error} (prompt_compression's keep markers)") from None


def line_pieces(text: str, size: int) -> list[str]:
    """`text` cut into consecutive pieces of about `size` characters or more, each cut just after a line end."""
    pieces, start = [], 0
    while start < len(text):
        cut = text.find("\n", start + size - 1)
        end = len(text) if cut < 0 else cut + 1
        pieces.append(text[start:end])
        start = end
    return pieces or [text]


def _windows(num_tokens: int, window: int) -> list[_Window]:
    """Windows of at most `window` tokens covering positions 1..num_tokens-1, each scored once: the first scores
    all it holds, each later one starts half a window before the previous one's end and scores the rest."""
    stride = max(1, window // 2)
    out: list[_Window] = []
    begin, scored_to = 0, 1
    while scored_to < num_tokens:
        end = min(begin + window, num_tokens)
        out.append(_Window(begin, end, scored_to))
        scored_to = end
        begin += stride
    return out


def build_prompt_compressor(engine_config: Any) -> PromptCompressor | None:
    """The compressor an EngineConfig asks for (`prompt_compressor`), on its device with its dtype; None when
    compression is off."""
    if engine_config.compressor is None:
        return None
    return PromptCompressor(engine_config.compressor, device=engine_config.device, dtype=engine_config.model.dtype,
                            cpu_threads=engine_config.cpu_threads)
