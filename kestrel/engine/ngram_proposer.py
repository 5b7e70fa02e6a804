"""N-gram (prompt lookup) proposals for speculative decoding (pure Python).

The last n tokens of a request (n from `max_n` down to `min_n`) are looked up earlier in its prompt and output;
the tokens that followed the latest earlier match are proposed, up to `k`. Repetitive text (code, edits,
quotes of the prompt) gets long proposals; anything else gets none, and costs one lookup.
"""

from __future__ import annotations

# How far back a lookup scans: bounds the host time per request and step on long contexts.
MAX_LOOKBACK = 4096


def propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    size = len(tokens)
    window_start = max(0, size - MAX_LOOKBACK)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        first = suffix[0]
        # Latest start i < size - n with tokens[i:i + n] == suffix, scanning backwards.
        i = size - n - 1
        while i >= window_start:
            try:
                i = _rindex(tokens, first, window_start, i)
            except ValueError:
                break
            if tokens[i:i + n] == suffix:
                follow = tokens[i + n: i + n + k]
                if follow:
                    return follow
            i -= 1
    return []


def _rindex(tokens: list[int], value: int, start: int, end: int) -> int:
    """The largest index in [start, end] holding `value`; ValueError if none."""
    for i in range(end, start - 1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)
