"""The check shared by the delta-output tests of the in-process engine and of the engine core process."""

from __future__ import annotations

import pytest

from kestrel import RequestOutput
from kestrel.entrypoints.async_engine import DeltaJoiner


def joined_deltas(outputs: list[RequestOutput]) -> dict[int, dict]:
    """Per sequence index: the delta outputs' text, token ids and logprobs joined, its finish reasons, and its
    last cumulative logprob."""
    joined: dict[int, dict] = {}
    for out in outputs:
        for c in out.outputs:
            assert c.text == c.delta_text and c.token_ids == c.delta_token_ids and c.logprobs == c.delta_logprobs
            seq = joined.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": [], "finishes": []})
            assert c.token_ids or c.finished  # a sequence appears only where it changed
            seq["text"] += c.text
            seq["token_ids"] += c.token_ids
            seq["logprobs"] += c.logprobs
            seq["cumulative_logprob"] = c.cumulative_logprob
            if c.finished:
                seq["finishes"].append((c.finish_reason, c.stop_reason))
    return joined


def same_logprobs(got: list | None, want: list | None) -> bool:
    """Per position, the same tokens with the same ranks and decoded text, and logprobs equal to float32 rounding:
    two requests for the same prompt may be batched differently (the engine core process forms its batches as the
    requests arrive), and a matmul of another shape rounds differently in the last bit."""
    if got is None or want is None:
        return got is want
    return len(got) == len(want) and all(
        (a is None and b is None) or (a is not None and b is not None and a.keys() == b.keys() and all(
            (a[t].rank, a[t].decoded_token) == (b[t].rank, b[t].decoded_token)
            and a[t].logprob == pytest.approx(b[t].logprob, rel=1e-5, abs=1e-5) for t in a))
        for a, b in zip(got, want))


def check_joined_deltas(deltas: list[RequestOutput], final: RequestOutput) -> None:
    """A request's delta outputs, joined, are `final` (the same request's last cumulative output): the prompt's
    logprobs come once, with the first; each sequence's finish once; only the last output is finished."""
    assert deltas[-1].finished and not any(out.finished for out in deltas[:-1])
    assert same_logprobs(deltas[0].prompt_logprobs, final.prompt_logprobs)
    assert all(out.prompt_logprobs is None for out in deltas[1:])
    joined = joined_deltas(deltas)
    assert sorted(joined) == sorted(c.index for c in final.outputs)
    for c in final.outputs:
        seq = joined[c.index]
        assert (seq["text"], seq["token_ids"]) == (c.text, c.token_ids)
        assert same_logprobs(seq["logprobs"], c.logprobs)
        assert seq["finishes"] == [(c.finish_reason, c.stop_reason)]
        assert seq["cumulative_logprob"] == pytest.approx(c.cumulative_logprob)
    # The server's join of a non-streamed request's delta outputs: the cumulative output's end.
    joiner = DeltaJoiner()
    for out in deltas:
        joiner.add(out)
    whole = joiner.joined()
    assert whole.finished and same_logprobs(whole.prompt_logprobs, final.prompt_logprobs)
    assert [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in whole.outputs] == [
        (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in final.outputs]
    assert all(same_logprobs(a.logprobs, b.logprobs) for a, b in zip(whole.outputs, final.outputs))
    assert [c.cumulative_logprob for c in whole.outputs] == pytest.approx([c.cumulative_logprob for c in final.outputs])
