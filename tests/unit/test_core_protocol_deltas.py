"""SequenceDeltas over the core process's pipe: every field survives the round trip through msgpack, in the plain
decode step's short form and in the full one (logprobs, prompt logprobs, metrics)."""

from __future__ import annotations

import pytest

from kestrel.entrypoints.core_protocol import delta_from_wire, delta_to_wire, pack, unpack
from kestrel.outputs import Logprob, RequestMetrics, SequenceDelta


def round_trip(delta: SequenceDelta, send_prompt_logprobs: bool) -> SequenceDelta:
    return delta_from_wire(unpack(pack(delta_to_wire(delta, send_prompt_logprobs))))


def test_a_plain_decode_step_round_trips():
    delta = SequenceDelta("r1", [7], None, None, None, 16, None, None, None)
    assert round_trip(delta, False) == delta


@pytest.mark.parametrize("send_prompt_logprobs", [False, True])
def test_every_field_round_trips(send_prompt_logprobs):
    logprobs = [{7: Logprob(-0.5, 1), 9: Logprob(-1.25, 2)}, None]
    prompt_logprobs = [None, {3: Logprob(-2.0, 4)}]
    metrics = RequestMetrics(1.0, 1.5, 2.0, 3.0, 1)
    delta = SequenceDelta("r2", [7, 8], logprobs, "stop", "</s>", 0, prompt_logprobs, metrics, [0.25, -1.0])
    got = round_trip(delta, send_prompt_logprobs)
    assert got == delta._replace(prompt_logprobs=prompt_logprobs if send_prompt_logprobs else None)
