"""Prompt compression's selection (pure Python): the target rate, protected spans, the coarse stage, markers."""

import math
import random
import re

import numpy as np
import pytest

from kestrel.entrypoints.compression_plan import (
    KeepMarkerError,
    ScoredToken,
    ScoredTokens,
    code_block_spans,
    literal_spans,
    merge_spans,
    segment_spans,
    select,
    strip_keep_markers,
    text_of,
)
from kestrel.sampling_params import KEEP_MARKERS, PromptCompression, SamplingParams, SamplingParamsError


def words(text: str, surprisal: dict[str, float] | None = None) -> list[ScoredToken]:
    """One token per space-led word, scored by `surprisal` (default: its length)."""
    tokens, start = [], 0
    for i, ch in enumerate(text + " "):
        if (ch == " " or ch == "\n" or i == len(text)) and i > start:
            word = text[start:i].strip()
            tokens.append(ScoredToken(start, (surprisal or {}).get(word, float(len(word)))))
            start = i
    return tokens


TEXT = "the cat sat on the mat and then the dog barked loudly at the strange visitor outside"


@pytest.mark.parametrize("rate", [0.8, 0.5, 0.33, 0.1])
def test_rate_is_reached(rate):
    tokens = words(TEXT)
    selection = select(TEXT, tokens, rate, [])
    assert selection.num_tokens == len(tokens)
    assert selection.num_kept == math.ceil(rate * len(tokens))
    assert sum(selection.kept) == selection.num_kept


def test_fine_stage_drops_the_least_surprising_tokens():
    scores = {"the": 0.1, "on": 0.2, "and": 0.3}
    selection = select(TEXT, words(TEXT, scores), 0.7, [])
    kept = text_of(TEXT, selection.kept_spans)
    assert not {"the", "on"} & set(kept.split()) and "strange visitor" in kept


def test_protected_spans_stay_verbatim_and_limit_what_can_drop():
    start = TEXT.index("the dog")
    protected = [(start, start + len("the dog barked"))]
    selection = select(TEXT, words(TEXT), 0.2, protected)
    kept = text_of(TEXT, selection.kept_spans)
    assert "the dog barked" in kept
    assert selection.num_kept >= math.ceil(0.2 * len(words(TEXT)))


def test_everything_protected_drops_nothing():
    selection = select(TEXT, words(TEXT), 0.3, [(0, len(TEXT))])
    assert text_of(TEXT, selection.kept_spans) == TEXT and selection.num_kept == selection.num_tokens


def test_unscored_tokens_stay():
    tokens = [ScoredToken(0, math.inf), *words(TEXT)[1:]]
    kept = text_of(TEXT, select(TEXT, tokens, 0.2, []).kept_spans)
    assert kept.startswith("the")


def test_coarse_stage_drops_whole_dull_lines_first():
    text = "alpha beta gamma\nfiller filler filler KEYWORD\ndelta epsilon zeta\n"
    scores = {"filler": 0.01, "KEYWORD": 3.0, "beta": 2.0}
    # word-led tokens, each with its trailing whitespace, so every line is whole tokens
    tokens = [ScoredToken(m.start(), scores.get(m.group().strip(), 5.0)) for m in re.finditer(r"\S+\s*", text)]
    selection = select(text, tokens, 0.6, [])
    kept = text_of(text, selection.kept_spans)
    # token by token, beta (2.0) would go before KEYWORD (3.0); the dull line goes whole instead
    assert kept == "alpha beta gamma\ndelta epsilon zeta\n"
    assert selection.num_kept == math.ceil(0.6 * len(tokens))


def test_the_same_input_gives_the_same_selection():
    tokens = words(TEXT, {"the": 1.0, "cat": 1.0, "sat": 1.0})  # ties broken by position
    assert select(TEXT, tokens, 0.5, []) == select(TEXT, list(tokens), 0.5, [])


def test_keep_markers_are_removed_and_their_spans_reported():
    opening, closing = KEEP_MARKERS
    text = f"drop this {opening}keep this{closing} and more"
    stripped, spans, offsets = strip_keep_markers(text)
    assert stripped == "drop this keep this and more"
    assert [stripped[a:b] for a, b in spans] == ["keep this"]
    assert offsets[text.index("and")] == stripped.index("and") and offsets[len(text)] == len(stripped)


@pytest.mark.parametrize("text", [f"{KEEP_MARKERS[0]} a", f"a {KEEP_MARKERS[1]}",
                                  f"{KEEP_MARKERS[0]}a{KEEP_MARKERS[0]}b{KEEP_MARKERS[1]}{KEEP_MARKERS[1]}"])
def test_unpaired_keep_markers_are_refused(text):
    with pytest.raises(KeepMarkerError):
        strip_keep_markers(text)


def test_code_blocks_literals_and_segments():
    text = "intro\n```py\nx = 1\n```\nafter ```open"
    blocks = code_block_spans(text)
    assert [text[a:b] for a, b in blocks] == ["```py\nx = 1\n```", "```open"]
    assert literal_spans("a<s>b<s>", ["<s>"]) == [(1, 4), (5, 8)]
    sentences = "One. Two\nthree"
    assert [sentences[a:b] for a, b in segment_spans(sentences)] == ["One. ", "Two\n", "three"]


@pytest.mark.parametrize("value, param", [
    ({"rate": 0}, "prompt_compression.rate"), ({"rate": 1.01}, "prompt_compression.rate"),
    ({"rate": float("nan")}, "prompt_compression.rate"), ({}, "prompt_compression.rate"),
    ({"rate": 0.5, "ratio": 2}, "prompt_compression.ratio"),
    ({"rate": 0.5, "keep_spans": [[4, 2]]}, "prompt_compression.keep_spans"),
    ({"rate": 0.5, "keep_system": "yes"}, "prompt_compression.keep_system"),
])
def test_sampling_params_refuse_bad_options_by_name(value, param):
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(prompt_compression=value)
    assert error.value.param == param


def test_sampling_params_read_a_dict():
    params = SamplingParams(prompt_compression={"rate": 1, "keep_spans": [[0, 3]]})
    assert params.prompt_compression == PromptCompression(rate=1, keep_spans=((0, 3),))


# ----- the vectorized plan against a token-by-token one ----------------------------------------------------------

def _reference_select(text, tokens, rate, protected):
    """The plan the module docstring describes, one token at a time (the oracle for the numpy one)."""
    cells = [(0 if i == 0 else t.start, tokens[i + 1].start if i + 1 < len(tokens) else len(text))
             for i, t in enumerate(tokens)]
    spans, j, fixed = merge_spans(protected), 0, []
    for (start, end), token in zip(cells, tokens):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        fixed.append((j < len(spans) and spans[j][0] < end and start < end) or math.isinf(token.surprisal))
    total = sum(t.tokens for t in tokens)
    to_drop = total - math.ceil(rate * total)
    dropped, count = [False] * len(tokens), 0
    if to_drop > 0:
        segments, members, j = segment_spans(text), {}, 0
        for i, (start, _) in enumerate(cells):
            while j + 1 < len(segments) and segments[j][1] <= start:
                j += 1
            members.setdefault(j, []).append(i)
        candidates = []
        for segment, indices in members.items():
            if not any(fixed[i] for i in indices):
                size = sum(tokens[i].tokens for i in indices)
                candidates.append((sum(tokens[i].surprisal for i in indices) / size, segment, size, indices))
        for _, _, size, indices in sorted(candidates, key=lambda c: (c[0], c[1])):
            if count + size <= to_drop:
                for i in indices:
                    dropped[i] = True
                count += size
        order = sorted((i for i in range(len(tokens)) if not fixed[i] and not dropped[i]),
                       key=lambda i: (tokens[i].surprisal / tokens[i].tokens, i))
        for i in order:
            if count >= to_drop:
                break
            dropped[i] = True
            count += tokens[i].tokens
    kept = tuple(not d for d in dropped)
    kept_spans = merge_spans([cell for cell, keep in zip(cells, kept) if keep and cell[1] > cell[0]])
    return kept, tuple(kept_spans), total, total - count


def _reference_merge(offsets, values):
    merged, covered = [], 0
    for (start, end), value in zip(offsets, values):
        if merged and (start < covered or end <= start):
            last = merged[-1]
            merged[-1] = ScoredToken(last.start, last.surprisal + value, last.tokens + 1)
        else:
            merged.append(ScoredToken(start, value))
        covered = max(covered, end)
    return merged


@pytest.mark.parametrize("seed", range(40))
def test_vectorized_plan_matches_the_token_by_token_one(seed):
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(["ab", "c.", "def", "g!", "hij"]) for _ in range(rng.randint(0, 6)))
             for _ in range(rng.randint(1, 12))]
    text = "\n".join(lines) + rng.choice(["", "\n"])
    if not text:
        text = "x"
    offsets, position = [], 0
    while position < len(text):  # tokens of 1-4 characters, some sharing characters or empty (merged)
        end = min(len(text), position + rng.randint(1, 4))
        offsets.append((position, end))
        if rng.random() < 0.15:
            offsets.append((rng.randint(max(0, position - 1), end), end))
        if rng.random() < 0.05:
            offsets.append((end, end))
        position = end
    values = [rng.choice([math.inf, 0.5, 1.0, rng.random() * 6]) if i == 0 or rng.random() < 0.05
              else rng.choice([0.5, 1.0, rng.random() * 6]) for i in range(len(offsets))]
    reference_tokens = _reference_merge(offsets, values)
    tokens = ScoredTokens.merged(np.array([a for a, _ in offsets]), np.array([b for _, b in offsets]),
                                 np.array(values))
    assert [ScoredToken(*t) for t in zip(tokens.starts.tolist(), tokens.surprisal.tolist(),
                                          tokens.counts.tolist())] == reference_tokens
    protected = [tuple(sorted(rng.sample(range(len(text) + 1), 2))) for _ in range(rng.randint(0, 3))]
    for rate in (0.9, 0.5, 0.2):
        got = select(text, tokens, rate, protected)
        assert (got.kept, got.kept_spans, got.num_tokens, got.num_kept) == _reference_select(
            text, reference_tokens, rate, protected)


@pytest.mark.parametrize("text", ["", "one line", "a\nb\nc\n", "x" * 50 + "\n" + "y" * 10, "\n\n\n" * 20])
def test_line_pieces_cut_after_line_ends_and_cover_the_text(text):
    from kestrel.entrypoints.prompt_compression import line_pieces

    pieces = line_pieces(text, 8)
    assert "".join(pieces) == text
    assert all(p.endswith("\n") or i == len(pieces) - 1 for i, p in enumerate(pieces))
    assert all(len(p) >= 8 for p in pieces[:-1])
