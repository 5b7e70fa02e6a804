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


def check_joined_deltas(deltas: list[RequestOutput], final: RequestOutput) -> None:
    """A request's delta outputs, joined, are `final` (the same request's last cumulative output): the prompt's
    logprobs come once, with the first; each sequence's finish once; only the last output is finished."""
    assert deltas[-1].finished and not any(out.finished for out in deltas[:-1])
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    assert all(out.prompt_logprobs is None for out in deltas[1:])
    joined = joined_deltas(deltas)
    assert sorted(joined) == sorted(c.index for c in final.outputs)
    for c in final.outputs:
        seq = joined[c.index]
        assert (seq["text"], seq["token_ids"], seq["logprobs"]) == (c.text, c.token_ids, c.logprobs)
        assert seq["finishes"] == [(c.finish_reason, c.stop_reason)]
        assert seq["cumulative_logprob"] == pytest.approx(c.cumulative_logprob)
    # The server's join of a non-streamed request's delta outputs: the cumulative output's end.
    joiner = DeltaJoiner()
    for out in deltas:
        joiner.add(out)
    whole = joiner.joined()
    assert whole.finished and whole.prompt_logprobs == final.prompt_logprobs
    assert [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in whole.outputs] == [
        (c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in final.outputs]
    assert [c.cumulative_logprob for c in whole.outputs] == pytest.approx([c.cumulative_logprob for c in final.outputs])
