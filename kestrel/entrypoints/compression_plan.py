"""What prompt compression keeps, given each compressor token's surprisal (pure Python; the scoring is
`prompt_compression.py`'s).

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


@dataclass(frozen=True)
class Selection:
    kept: tuple[bool, ...]  # per ScoredToken
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


def token_cells(tokens: Sequence[ScoredToken], text_len: int) -> list[Span]:
    """The characters each token owns: from its start (the first from 0) to the next token's start."""
    cells = []
    for i, token in enumerate(tokens):
        start = 0 if i == 0 else token.start
        end = tokens[i + 1].start if i + 1 < len(tokens) else text_len
        cells.append((start, end))
    return cells


def _touches(cells: Sequence[Span], spans: Sequence[Span]) -> list[bool]:
    """Per cell: whether it overlaps one of the merged, sorted spans (an empty cell never does)."""
    out, j = [], 0
    for start, end in cells:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        out.append(j < len(spans) and spans[j][0] < end and start < end)
    return out


def select(text: str, tokens: Sequence[ScoredToken], rate: float, protected: Sequence[Span]) -> Selection:
    """Which tokens stay so that about `rate` of the compressor tokens are left (fewer are dropped when the
    protected ones leave too few to drop)."""
    cells = token_cells(tokens, len(text))
    protected_spans = merge_spans(protected)
    fixed = [touch or math.isinf(t.surprisal) for touch, t in zip(_touches(cells, protected_spans), tokens)]
    total = sum(t.tokens for t in tokens)
    to_drop = total - math.ceil(rate * total)
    dropped = [False] * len(tokens)
    count = 0
    if to_drop > 0:
        count = _drop_segments(text, tokens, cells, fixed, dropped, COARSE_SHARE * to_drop)
        order = sorted((i for i, t in enumerate(tokens) if not fixed[i] and not dropped[i]),
                       key=lambda i: (tokens[i].surprisal / tokens[i].tokens, i))
        for i in order:
            if count >= to_drop:
                break
            dropped[i] = True
            count += tokens[i].tokens
    kept = tuple(not d for d in dropped)
    spans = merge_spans([cell for cell, keep in zip(cells, kept) if keep and cell[1] > cell[0]])
    return Selection(kept, tuple(spans), total, total - count)


def _drop_segments(text: str, tokens: Sequence[ScoredToken], cells: Sequence[Span], fixed: Sequence[bool],
                   dropped: list[bool], budget: float) -> int:
    """The coarse stage: drops whole unprotected segments, lowest mean surprisal first, within `budget` tokens."""
    members: dict[int, list[int]] = {}
    segments = segment_spans(text)
    j = 0
    for i, (start, _) in enumerate(cells):
        while j + 1 < len(segments) and segments[j][1] <= start:
            j += 1
        members.setdefault(j, []).append(i)
    candidates = []
    for segment, indices in members.items():
        if any(fixed[i] for i in indices):
            continue
        size = sum(tokens[i].tokens for i in indices)
        mean = sum(tokens[i].surprisal for i in indices) / size
        candidates.append((mean, segment, size, indices))
    count = 0
    for _, _, size, indices in sorted(candidates, key=lambda c: (c[0], c[1])):
        if count + size > budget:
            continue
        for i in indices:
            dropped[i] = True
        count += size
    return count


def text_of(text: str, spans: Sequence[Span], region: Span | None = None) -> str:
    """The kept characters (of `region` only, when given), in order."""
    lo, hi = region if region is not None else (0, len(text))
    return "".join(text[max(a, lo): min(b, hi)] for a, b in spans if a < hi and b > lo)
