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


def test_delta_outputs_carry_the_prompts_logprobs_whichever_sequence_comes_first():
    """n = 2 rebuilt by the core process's client: the first output carries the prompt's logprobs even when the
    second sequence's step arrives first, and no later output carries them again."""
    from kestrel.entrypoints.core_outputs import ClientRequest, child_id
    from kestrel.loader.tokenizer import load_tokenizer
    from kestrel.sampling_params import SamplingParams
    from kestrel.tiny import default_model_path

    tokenizer = load_tokenizer(str(default_model_path()))
    params = SamplingParams(n=2, max_tokens=2, prompt_logprobs=1, output_kind="delta")
    request = ClientRequest("r", None, [5, 6, 7], params, tokenizer, lambda t: str(t))
    prompt = [None, {6: Logprob(-1.0, 1)}, {7: Logprob(-2.0, 1)}]

    def step(index: int, token: int, finish: str | None) -> None:
        request.apply(SequenceDelta(child_id("r", index, 2), [token], None, finish, None, 0, prompt, None, None))

    step(1, 40, None)
    first = request.output()
    assert [c.index for c in first.outputs] == [1]
    assert [list(e or {}) for e in first.prompt_logprobs] == [[], [6], [7]]
    step(0, 41, None)
    step(0, 42, "length")
    step(1, 43, "length")
    last = request.output()
    assert last.finished and last.prompt_logprobs is None
    assert {c.index: c.token_ids for c in last.outputs} == {0: [41, 42], 1: [43]}


def test_a_request_without_detokenization_gets_token_ids_only_from_the_client():
    """SamplingParams(detokenize=False) through the core process's client: no text, no logprob token texts."""
    from kestrel.entrypoints.core_outputs import ClientRequest
    from kestrel.loader.tokenizer import load_tokenizer
    from kestrel.sampling_params import SamplingParams
    from kestrel.tiny import default_model_path

    tokenizer = load_tokenizer(str(default_model_path()))
    for detokenize in (True, False):
        params = SamplingParams(max_tokens=2, logprobs=1, detokenize=detokenize)
        request = ClientRequest("r", None, [5, 6, 7], params, tokenizer, lambda t: f"<{t}>")
        request.apply(SequenceDelta("r", [40], [{40: Logprob(-0.5, 1)}], None, None, 0, None, None, None))
        request.apply(SequenceDelta("r", [41], [{41: Logprob(-0.7, 1)}], "length", None, 0, None, None, None))
        out = request.output().outputs[0]
        assert out.token_ids == [40, 41]
        assert (out.text == "") is (not detokenize) and (out.text == tokenizer.decode([40, 41])) is detokenize
        assert [lp[t].decoded_token for t, lp in zip(out.token_ids, out.logprobs)] == (
            ["<40>", "<41>"] if detokenize else [None, None])
