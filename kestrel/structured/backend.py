"""The xgrammar backend: compile, match, fill bitmasks. See the package docstring for the contract."""

from __future__ import annotations

import os
import time
from typing import Any

from kestrel.engine.contracts import GrammarBitmask
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import StructuredOutputsParams
from kestrel.structured.compile import (
    JSON_MAX_WHITESPACE,
    GrammarCompileError,
    GrammarSource,
    choice_grammar,
    compile_source,
)
from kestrel.structured.limits import GrammarLimits, check_structured_outputs

__all__ = ["GrammarBackend", "JSON_MAX_WHITESPACE", "choice_grammar"]
DEFAULT_CACHE_BYTES = 256 << 20


class GrammarBackend:
    """Per engine: the tokenizer's vocabulary as xgrammar sees it, a compiler with its cache, the matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 max_threads: int | None = None, gpu_host: bool = False, limits: GrammarLimits | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        """`gpu_host`: the runner of this process is on a GPU (masks are pinned and filled in xgrammar's threads).
        `limits`: what a grammar this backend compiles itself may be (the server checks and compiles the grammars
        of its requests before they reach the engine, under its own flags); `cache_bytes`: the most memory the
        compiler's cache of grammars may hold."""
        self._tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self._cache_bytes = cache_bytes
        self._tokenizer_info: Any = None
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        # Compilation runs in xgrammar's threads (up to 8 of the host's cores), and so does the bitmask fill of a
        # GPU host (`gpu_host`: its runner keeps torch's CPU ops on one thread, so no idle torch pool spins on
        # the cores; 64 rows of a JSON schema, 128k vocabulary, H200 host: 1.2 ms on one thread, 0.55 ms on 8).
        # Elsewhere torch's own pool spins between ops and the fill's threads wait for cores: one thread fills.
        self._max_threads = max_threads or max(1, min(8, os.cpu_count() or 1))
        self._fill_threads = self._max_threads if gpu_host else 1
        self.worker_count = 0  # processes holding the matchers (GrammarShards); 0: this thread
        self._compiler: Any = None
        self._matchers: dict[str, Any] = {}
        self._batch: Any = None
        # Bitmasks are filled into two buffers used in turn (a step's mask may still be copying to the device
        # while the next one is filled), pinned on a GPU host: a fresh allocation, gather and pinned copy per step
        # woke torch's CPU thread pool, whose spinning threads then slowed the fill itself.
        self._pin_memory = gpu_host
        self._buffers: list[Any] = [None, None]
        self._turn = 0
        self.fill_seconds = 0.0  # host time spent filling bitmasks (for the benchmarks)
        self.num_fills = 0
        self.accept_seconds = 0.0  # host time spent advancing matchers (for the benchmarks)

    @property
    def tokenizer_info(self) -> Any:
        """The vocabulary as xgrammar reads it (xgr.TokenizerInfo), built on first use: reading a large vocabulary
        takes a moment, and most engines never need it. The server compiles its requests' grammars against it."""
        if self._tokenizer_info is None:
            import xgrammar as xgr

            self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                                      stop_token_ids=self._eos or None)
        return self._tokenizer_info

    def use_tokenizer_info(self, serialized: str) -> None:
        """The vocabulary as another process read it (TokenizerInfo.serialize_json): the grammar backend of an
        engine core in its own process, which holds no tokenizer."""
        import xgrammar as xgr

        self._tokenizer_info = xgr.TokenizerInfo.deserialize_json(serialized)

    @property
    def max_threads(self) -> int:
        return self._max_threads

    @property
    def compiler(self) -> Any:
        """Built on first use, with a cache of compiled grammars bounded by `cache_bytes`."""
        if self._compiler is None:
            import xgrammar as xgr

            self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=self._max_threads,
                                                 cache_enabled=True, cache_limit_bytes=self._cache_bytes)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`, within `limits`; a grammar beyond them, or one the compiler rejects, is
        an InvalidRequestError naming it. Compiling blocks the caller (the engine's thread): the server hands the
        engine its grammars compiled."""
        param = f"structured_outputs.{spec.kind}"
        check_structured_outputs(spec, param, self.limits)
        try:
            return compile_source(self.compiler, GrammarSource.of(spec))
        except GrammarCompileError as error:
            raise InvalidRequestError(param, str(error)) from None

    def add(self, request_id: str, spec: StructuredOutputsParams, compiled: Any = None) -> None:
        """Start the request's matcher: on `compiled` (an xgrammar CompiledGrammar of `spec`, compiled against
        `tokenizer_info`) when given, else on the grammar compiled here."""
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(compiled if compiled is not None else self.compile(spec))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def accept_many(self, new_tokens: dict[str, list[int]]) -> dict[str, int]:
        """Advance each request's matcher with its new tokens; per request, how many the grammar accepted (in
        order). The usual step, one token per request, goes to xgrammar in one batched call."""
        started = time.perf_counter()
        counts = advance_matchers(self._matchers, new_tokens)
        self.accept_seconds += time.perf_counter() - started
        return counts

    def accept(self, request_id: str, token_ids: list[int]) -> int:
        """Advance the request's matcher; returns how many of the tokens the grammar accepted (in order)."""
        matcher = self._matchers.get(request_id)
        return len(token_ids) if matcher is None else accept_tokens(matcher, token_ids)

    def is_terminated(self, request_id: str) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of proposed tokens the request's grammar accepts (its matcher left as it was)."""
        matcher = self._matchers.get(request_id)
        return [] if matcher is None else valid_draft_prefix(matcher, drafts)

    def bitmask(self, request_ids: list[str], drafts: dict[str, list[int]] | None = None) -> GrammarBitmask:
        """The next-token bitmask of each request (int32 rows on the host). A request verifying drafts gets
        one row per verified position, in order: the grammar's state after each draft (drafts the grammar
        accepts, as the proposals were checked with `valid_drafts`)."""
        import xgrammar as xgr

        started = time.perf_counter()
        rows = [rid for rid in request_ids if rid in self._matchers]
        drafts = {rid: d for rid, d in (drafts or {}).items() if rid in self._matchers and d}
        if drafts:
            return self._bitmask_with_drafts(rows, drafts, started)
        bitmask = self._buffer(len(rows))
        if len(rows) == 1:
            self._matchers[rows[0]].fill_next_token_bitmask(bitmask, 0)
        elif rows:  # the rows in one call, in xgrammar's threads on a GPU host
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=self._fill_threads)
            self._batch.batch_fill_next_token_bitmask([self._matchers[rid] for rid in rows], bitmask)
        self.fill_seconds += time.perf_counter() - started
        self.num_fills += 1
        return GrammarBitmask(rows, bitmask)

    def _buffer(self, num_rows: int) -> Any:
        """The first `num_rows` rows of this step's bitmask buffer (grown to the next power of two as needed)."""
        import xgrammar as xgr

        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.shape[0] < num_rows:
            buffer = xgr.allocate_token_bitmask(1 << max(num_rows - 1, 0).bit_length(), self.vocab_size)
            if self._pin_memory:
                buffer = buffer.pin_memory()
            self._buffers[self._turn] = buffer
        return buffer[:num_rows]

    def _bitmask_with_drafts(self, rows: list[str], drafts: dict[str, list[int]], started: float) -> GrammarBitmask:
        req_ids = [rid for rid in rows for _ in range(len(drafts.get(rid, ())) + 1)]
        bitmask = self._buffer(len(req_ids))
        row = 0
        for rid in rows:
            row = fill_draft_rows(self._matchers[rid], drafts.get(rid, []), bitmask, row)
        self.fill_seconds += time.perf_counter() - started
        self.num_fills += 1
        return GrammarBitmask(req_ids, bitmask)


# ----- matcher operations, shared with the grammar workers (structured/shards.py) ------------------------


def advance_matchers(matchers: dict[str, Any], new_tokens: dict[str, list[int]]) -> dict[str, int]:
    """Per request of `new_tokens`, how many of its tokens its matcher accepted, in order (a request without a
    matcher: all of them). One token per request goes to xgrammar in one batched call."""
    import xgrammar as xgr

    counts = {rid: len(tokens) for rid, tokens in new_tokens.items() if rid not in matchers}
    singles = [(rid, tokens[0]) for rid, tokens in new_tokens.items()
               if len(tokens) == 1 and rid in matchers and not matchers[rid].is_terminated()]
    if singles:
        results = xgr.BatchGrammarMatcher.batch_accept_token([matchers[rid] for rid, _ in singles],
                                                             [token for _, token in singles])
        counts.update({rid: int(ok) for (rid, _), ok in zip(singles, results)})
    for rid, tokens in new_tokens.items():
        if rid not in counts:
            counts[rid] = accept_tokens(matchers[rid], tokens)
    return counts


def accept_tokens(matcher: Any, token_ids: list[int]) -> int:
    """Advance `matcher`; how many of the tokens the grammar accepted (in order)."""
    for count, token_id in enumerate(token_ids):
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            return count
    return len(token_ids)


def valid_draft_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the grammar accepts, `matcher` left as it was."""
    if matcher.is_terminated():
        return []
    count = 0
    for token_id in drafts:
        if not matcher.accept_token(token_id):
            break
        if matcher.is_terminated():  # the draft ends the grammar: the request decides that itself
            matcher.rollback(1)
            break
        count += 1
    if count:
        matcher.rollback(count)
    return drafts[:count]


def fill_draft_rows(matcher: Any, drafts: list[int], bitmask: Any, row: int) -> int:
    """The rows of a request verifying `drafts`, from `row` on: the grammar's state after each draft (drafts the
    grammar accepts, as the proposals were checked with `valid_draft_prefix`), then after all of them; after a
    draft the grammar rejects, the rows repeat its state (verification stops there anyway). Returns the next row."""
    accepted, valid = 0, True
    for token_id in drafts:
        matcher.fill_next_token_bitmask(bitmask, row)
        row += 1
        valid = valid and not matcher.is_terminated() and matcher.accept_token(token_id)
        accepted += valid
    matcher.fill_next_token_bitmask(bitmask, row)
    if accepted:
        matcher.rollback(accepted)
    return row + 1
