"""The host side of a step: the persistent block table, final-only and delta outputs."""

from __future__ import annotations

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
