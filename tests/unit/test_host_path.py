"""The host side of a step: the persistent block table, final-only and delta outputs."""

from __future__ import annotations

import dataclasses

import pytest
from delta_outputs import check_joined_deltas

from kestrel import LLM, CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from kestrel.entrypoints.async_engine import merge_outputs
from kestrel.outputs import Logprob
from kestrel.sampling_params import SamplingParamsError
from kestrel.tiny import default_model_path
from kestrel.worker.input_batch import BlockTable


def test_block_table_rows_append_gather_and_reuse() -> None:
    table = BlockTable(max_rows=3, max_blocks_per_seq=4)
    a = table.add([5, 6])
    b = table.add([9])
    table.append(b, [1, 2])
    table.append(a, [7])
    assert table.gather([b, a], 3).tolist() == [[9, 1, 2], [5, 6, 7]]
    table.free(a)
    c = table.add([3])
    assert c == a  # a freed row is reused; its stale tail is beyond the new request's blocks
    assert table.gather([c], 1).tolist() == [[3]]
    with pytest.raises(ValueError, match="max_blocks_per_seq=4"):
        table.append(b, [4, 4])
    table.add([0])
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        table.add([0])


def test_output_kind_is_validated() -> None:
    with pytest.raises(SamplingParamsError, match="output_kind"):
        SamplingParams(output_kind="partial")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(default_model_path()), max_num_seqs=4, max_model_len=256)


@pytest.mark.parametrize("stop", [[], ["\n"]])
def test_final_only_gives_one_output_with_the_same_text(llm: LLM, stop: list[str]) -> None:
    prompts = ["def __init__(self", "import os", "class A:", "for i in range(10):", "x = ["]
    cumulative = SamplingParams(temperature=0.0, max_tokens=24, stop=stop)
    final = cumulative.replace(output_kind="final_only")
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    per_kind = {}
    for params in (cumulative, final):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{params.output_kind}-{i}", tokenizer.encode(prompt), params, prompt=prompt)
        seen: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen.setdefault(out.request_id, []).append(out)
        per_kind[params.output_kind] = seen
    for i in range(len(prompts)):
        steps = per_kind["cumulative"][f"cumulative-{i}"]
        (only,) = per_kind["final_only"][f"final_only-{i}"]
        assert only.finished and len(steps) == len(steps[-1].outputs[0].token_ids)  # one per step vs one
        assert only.outputs[0].text == steps[-1].outputs[0].text
        assert only.outputs[0].token_ids == steps[-1].outputs[0].token_ids
        assert only.outputs[0].finish_reason == steps[-1].outputs[0].finish_reason
        # the delta of the single output is the whole completion
        assert only.outputs[0].delta_text == only.outputs[0].text
    assert any(len(steps) > 1 for steps in per_kind["cumulative"].values())


def test_output_kind_takes_vllms_enum_by_name() -> None:
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind == "delta"
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).final_only
    assert SamplingParams(output_kind="delta").delta_outputs


@pytest.mark.parametrize("stop", [[], ["\n"]])
def test_delta_outputs_join_to_the_cumulative_ones(llm: LLM, stop: list[str]) -> None:
    """n = 2 sampled sequences with logprobs and prompt logprobs: each delta output holds only what its step added,
    and joined they are the cumulative output, the prompt's logprobs once, each finish once."""
    prompts = ["def __init__(self", "import os", "class A:"]
    cumulative = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=20, logprobs=2, prompt_logprobs=1,
                                stop=stop)
    delta = cumulative.replace(output_kind="delta")
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    seen: dict[str, dict[str, list[RequestOutput]]] = {}
    for params in (cumulative, delta):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{params.output_kind}-{i}", tokenizer.encode(prompt), params, prompt=prompt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen.setdefault(params.output_kind, {}).setdefault(out.request_id, []).append(out)
    for i in range(len(prompts)):
        check_joined_deltas(seen["delta"][f"delta-{i}"], seen["cumulative"][f"cumulative-{i}"][-1])
    assert any(len(outs) > 2 for outs in seen["delta"].values())


def test_a_slow_readers_delta_outputs_merge_into_one() -> None:
    """The stream's merge of outputs waiting to be read: delta outputs join their text and ids, keep a sequence
    that changed only in the earlier one and the prompt's logprobs that came with it."""
    def out(outputs: list[CompletionOutput], prompt_logprobs=None, finished=False) -> RequestOutput:
        return RequestOutput("r", None, [1, 2], outputs, finished, prompt_logprobs=prompt_logprobs)

    def seq(index: int, ids: list[int], text: str, finish: str | None = None) -> CompletionOutput:
        return CompletionOutput(index, text, ids, finish_reason=finish, delta_text=text, delta_token_ids=ids)

    earlier = out([seq(0, [5], "a"), seq(1, [6], "b")], prompt_logprobs=[None, {2: Logprob(-0.5)}])
    later = out([seq(0, [7, 8], "cd", "length")])
    merged = merge_outputs(earlier, later, delta=True)
    assert [(c.index, c.text, c.token_ids, c.delta_token_ids, c.finish_reason) for c in merged.outputs] == [
        (0, "acd", [5, 7, 8], [5, 7, 8], "length"), (1, "b", [6], [6], None)]
    assert merged.prompt_logprobs == earlier.prompt_logprobs


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm: LLM, include: bool) -> None:
    """A sequence ended by a stop token id or EOS keeps the token in token_ids; its text is left out of the text
    unless include_stop_str_in_output (vLLM's detokenizer, as for stop strings)."""
    tokenizer = llm.get_tokenizer()
    equals = tokenizer.convert_tokens_to_ids("=")
    prompt = "def __init__(self"
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0].outputs[0]
    assert equals in plain.token_ids
    cut = plain.token_ids.index(equals) + 1
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[equals], include_stop_str_in_output=include)
    for kind in ("cumulative", "delta"):
        outputs = []
        engine = llm.engine
        engine.add_request(f"stop-token-{kind}-{include}", tokenizer.encode(prompt), params.replace(output_kind=kind))
        while engine.has_unfinished_requests():
            outputs += engine.step()
        final = outputs[-1].outputs[0]
        text = final.text if kind == "cumulative" else "".join(out.outputs[0].delta_text for out in outputs)
        assert final.finish_reason == "stop" and final.stop_reason == equals
        assert text == tokenizer.decode(plain.token_ids[:cut if include else cut - 1])
    chat = [{"role": "user", "content": "What does `os.path.join` do?"}]
    ended = llm.chat(chat, SamplingParams(max_tokens=60, temperature=0, skip_special_tokens=False,
                                          include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
    assert ended.token_ids[-1] == tokenizer.eos_token_id
    assert ended.text.endswith(tokenizer.eos_token) == include


def test_cumulative_text_only_grows_while_a_stop_string_may_match(llm: LLM) -> None:
    """A step's cumulative text holds back what a stop string may yet take back (and a character split across
    tokens), as its delta does: each output's text is the one before plus its delta."""
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    engine.add_request("grows", tokenizer.encode("def __init__(self"),
                       SamplingParams(max_tokens=20, temperature=0, stop=["=None, li"]))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    texts = [out.outputs[0].text for out in outputs]
    assert outputs[-1].outputs[0].stop_reason == "=None, li"
    assert all(b == a + out.outputs[0].delta_text for a, b, out in zip(["", *texts], texts, outputs))


def test_a_requests_metrics_are_handed_out_again_until_they_change(llm: LLM) -> None:
    """A streamed request's outputs share one RequestMetrics while it says what a new one would; its first token
    time and its finish give new ones, and no handed-out metrics change afterwards."""
    engine = llm.engine
    engine.add_request("m", llm.get_tokenizer().encode("import os"),
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind="delta"))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [(out.metrics, dataclasses.astuple(out.metrics)) for out in engine.step() if out.request_id == "m"]
    assert len(outputs) > 3
    assert all(dataclasses.astuple(metrics) == seen for metrics, seen in outputs)  # none changed in place
    running, (final, _) = [m for m, _ in outputs[:-1]], outputs[-1]
    assert all(m is running[0] for m in running) and running[0].first_token_time is not None
    assert running[0].finished_time is None and final is not running[0] and final.finished_time is not None
    assert final.first_token_time == running[0].first_token_time
