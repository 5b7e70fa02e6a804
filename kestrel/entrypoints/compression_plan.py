"""What prompt compression keeps, given each compressor token's surprisal (numpy, vectorized: a long prompt's
plan costs milliseconds; the scoring is `prompt_compression.py`'s).

The text is partitioned into its compressor tokens: token i owns the characters from its start to the next
token's start (so whitespace a tokenizer leaves out of its offsets goes with the token after it). A token that
touches a protected span (kept verbatim) is never dropped. Of the N tokens, about `rate * N` stay:

1. coarse: whole segments (lines, and sentences within long lines) with no protected token go first, lowest mean
   surprisal first, while they fit in `COARSE_SHARE` of the tokens to drop (a segment that would pass it is
   skipped for a smaller one);
2. fine: the remaining unprotected tokens, lowest surprisal first (position breaks ties), until the target.

Everything is a function of the text, the surprisals and the options, so the same prompt and rate always give the
same compressed prompt (which is what lets a repeated compressed prompt hit the prefix cache).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kestrel.sampling_params import KEEP_MARKERS

Span = tuple[int, int]  # [start, end) character offsets

# The share of the tokens to drop that whole segments may make up. Chosen on train-split samples (32 contexts of
# 384 tokens, kestrel-tiny; continuation perplexity at rates 0.8 / 0.5 / 0.33 for shares 0.5, 0.75, 0.9, 1.0): the
# whole budget did best at 0.5 and 0.33 and within 2% of the best at 0.8. The held-out split was not used.
COARSE_SHARE = 1.0
_SEGMENT_END = re.compile(r"\n|(?<=[.!?;])[ \t]+")
_CODE_FENCE = re.compile(r"```")


class KeepMarkerError(ValueError):
    """The keep markers of a prompt do not pair up."""


@dataclass(frozen=True)
class ScoredToken:
    """One compressor token (or several that share characters, such as the bytes of one UTF-8 character):
    where its text starts, its surprisal -ln p(token | prefix) in nats (inf: not scored, e.g. the first token),
    and how many compressor tokens it stands for."""

    start: int
    surprisal: float
    tokens: int = 1


@dataclass(frozen=True, eq=False)
class ScoredTokens:
    """ScoredTokens as arrays, in text order: `starts` (int64, non-decreasing), `surprisal` (float64), `counts`
    (int64, the compressor tokens each stands for)."""

    starts: np.ndarray
    surprisal: np.ndarray
    counts: np.ndarray

    @staticmethod
    def of(tokens: Sequence[ScoredToken]) -> ScoredTokens:
        return ScoredTokens(np.array([t.start for t in tokens], dtype=np.int64),
                            np.array([t.surprisal for t in tokens], dtype=np.float64),
                            np.array([t.tokens for t in tokens], dtype=np.int64))

    @staticmethod
    def merged(starts: np.ndarray, ends: np.ndarray, surprisal: np.ndarray) -> ScoredTokens:
        """Tokens from a tokenizer's character offsets ([start, end) each) and surprisals: a token that starts
        inside the characters already covered, or covers none, is merged into the one before it (the bytes of one
        UTF-8 character, say), summing their surprisals."""
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        covered = np.maximum.accumulate(ends)
        joins = np.zeros(len(starts), dtype=bool)
        joins[1:] = (starts[1:] < covered[:-1]) | (ends[1:] <= starts[1:])
        group = np.cumsum(~joins) - 1
        heads = np.flatnonzero(~joins)
        return ScoredTokens(starts[heads], np.bincount(group, weights=np.asarray(surprisal, dtype=np.float64)),
                            np.bincount(group).astype(np.int64))

    def __len__(self) -> int:
        return len(self.starts)


@dataclass(frozen=True)
class Selection:
    kept: tuple[bool, ...]  # per scored token
    kept_spans: tuple[Span, ...]  # the characters of the kept tokens, merged
    num_tokens: int
    num_kept: int


def strip_keep_markers(text: str) -> tuple[str, list[Span], list[int]]:
    """The text without KEEP_MARKERS, the marked spans in it, and for each original offset (and the end) its
    offset in the stripped text. KeepMarkerError when markers nest or do not pair up."""
    opening, closing = KEEP_MARKERS
    pieces: list[str] = []
    spans: list[Span] = []
    offset_map: list[int] = []
    position, stripped_len, open_at = 0, 0, None
    pattern = re.compile(f"{re.escape(opening)}|{re.escape(closing)}")
    for match in pattern.finditer(text):
        piece = text[position: match.start()]
        pieces.append(piece)
        offset_map.extend(range(stripped_len, stripped_len + len(piece)))
        stripped_len += len(piece)
        offset_map.extend([stripped_len] * (match.end() - match.start()))
        if match.group() == opening:
            if open_at is not None:
                raise KeepMarkerError(f"{opening} at character {match.start()} opens a span inside another one")
            open_at = stripped_len
        else:
            if open_at is None:
                raise KeepMarkerError(f"{closing} at character {match.start()} closes no span")
            if stripped_len > open_at:
                spans.append((open_at, stripped_len))
            open_at = None
        position = match.end()
    if open_at is not None:
        raise KeepMarkerError(f"a {opening} is never closed by {closing}")
    rest = text[position:]
    pieces.append(rest)
    offset_map.extend(range(stripped_len, stripped_len + len(rest) + 1))
    return "".join(pieces), spans, offset_map


def code_block_spans(text: str) -> list[Span]:
    """Fenced code blocks (``` to ```, an unclosed fence to the end of the text)."""
    fences = [m.start() for m in _CODE_FENCE.finditer(text)]
    spans = []
    for i in range(0, len(fences), 2):
        end = fences[i + 1] + 3 if i + 1 < len(fences) else len(text)
        spans.append((fences[i], end))
    return spans


def literal_spans(text: str, needles: Sequence[str]) -> list[Span]:
    """Every occurrence of each needle (the served tokenizer's special-token texts in a text prompt)."""
    spans = []
    for needle in needles:
        if needle:
            spans.extend((m.start(), m.end()) for m in re.finditer(re.escape(needle), text))
    return spans


def segment_spans(text: str) -> list[Span]:
    """Lines, and sentences within a line: the units the coarse stage drops whole."""
    spans, start = [], 0
    for match in _SEGMENT_END.finditer(text):
        if match.end() > start:
            spans.append((start, match.end()))
            start = match.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def merge_spans(spans: Sequence[Span]) -> list[Span]:
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def select(text: str, tokens: ScoredTokens | Sequence[ScoredToken], rate: float,
           protected: Sequence[Span]) -> Selection:
    """Which tokens stay so that about `rate` of the compressor tokens are left (fewer are dropped when the
    protected ones leave too few to drop)."""
    if not isinstance(tokens, ScoredTokens):
        tokens = ScoredTokens.of(tokens)
    n = len(tokens)
    if n == 0:
        return Selection((), (), 0, 0)
    cell_starts = tokens.starts.copy()
    cell_starts[0] = 0
    cell_ends = np.append(tokens.starts[1:], len(text)).astype(np.int64)
    fixed = _touches(cell_starts, cell_ends, merge_spans(protected)) | np.isinf(tokens.surprisal)
    total = int(tokens.counts.sum())
    to_drop = total - math.ceil(rate * total)
    dropped = np.zeros(n, dtype=bool)
    count = 0
    if to_drop > 0:
        count = _drop_segments(text, tokens, cell_starts, fixed, dropped, COARSE_SHARE * to_drop)
        free = np.flatnonzero(~fixed & ~dropped)
        per_token = tokens.surprisal[free] / tokens.counts[free]
        order = free[np.lexsort((free, per_token))]  # lowest surprisal per token first, position breaks ties
        before = count + np.cumsum(tokens.counts[order]) - tokens.counts[order]
        chosen = order[before < to_drop]
        dropped[chosen] = True
        count += int(tokens.counts[chosen].sum())
    kept = ~dropped & (cell_ends > cell_starts)
    # the cells tile the text, so kept cells merge into one span exactly when nothing but empty cells lies between
    run_starts, run_ends = cell_starts[kept], cell_ends[kept]
    breaks = np.flatnonzero(run_starts[1:] != run_ends[:-1]) + 1
    first, last = np.append(0, breaks), np.append(breaks, len(run_starts)) - 1
    spans = tuple(zip(run_starts[first].tolist(), run_ends[last].tolist())) if len(run_starts) else ()
    return Selection(tuple((~dropped).tolist()), spans, total, total - count)


def _touches(cell_starts: np.ndarray, cell_ends: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """Per cell: whether it overlaps one of the merged, sorted spans (an empty cell never does)."""
    if not spans:
        return np.zeros(len(cell_starts), dtype=bool)
    span_starts = np.array([a for a, _ in spans], dtype=np.int64)
    span_ends = np.array([b for _, b in spans], dtype=np.int64)
    j = np.searchsorted(span_ends, cell_starts, side="right")  # the first span ending after the cell starts
    inside = j < len(spans)
    return inside & (span_starts[np.minimum(j, len(spans) - 1)] < cell_ends) & (cell_starts < cell_ends)


def _drop_segments(text: str, tokens: ScoredTokens, cell_starts: np.ndarray, fixed: np.ndarray, dropped: np.ndarray,
                   budget: float) -> int:
    """The coarse stage: drops whole unprotected segments, lowest mean surprisal first, within `budget` tokens."""
    segments = segment_spans(text)
    segment_ends = np.array([b for _, b in segments], dtype=np.int64)
    member_of = np.minimum(np.searchsorted(segment_ends, cell_starts, side="right"), max(len(segments) - 1, 0))
    groups = max(len(segments), 1)
    has_fixed = np.bincount(member_of, weights=fixed, minlength=groups) > 0
    sizes = np.bincount(member_of, weights=tokens.counts, minlength=groups)
    sums = np.bincount(member_of, weights=np.where(fixed, 0.0, tokens.surprisal), minlength=groups)
    candidates = np.flatnonzero(~has_fixed & (sizes > 0))
    means = sums[candidates] / sizes[candidates]
    order = candidates[np.lexsort((candidates, means))]
    count = 0
    chosen = []
    for segment, size in zip(order.tolist(), sizes[order].astype(np.int64).tolist()):
        if count + size > budget:
            continue
        chosen.append(segment)
        count += size
    if chosen:
        dropped |= np.isin(member_of, chosen)
    return count


def text_of(text: str, spans: Sequence[Span], region: Span | None = None) -> str:
    """The kept characters (of `region` only, when given), in order."""
    lo, hi = region if region is not None else (0, len(text))
    return "".join(text[max(a, lo): min(b, hi)] for a, b in spans if a < hi and b > lo)
