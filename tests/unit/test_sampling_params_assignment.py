"""SamplingParams fields assigned after construction, as vLLM's examples do (`params.max_tokens = 32`): checked as a
new SamplingParams would be, a refused value leaving the params unchanged; `clone` is a deep copy."""

import pickle

import pytest

from kestrel import SamplingParams
from kestrel.sampling_params import SamplingParamsError


def test_an_assigned_field_is_normalized_and_kept():
    params = SamplingParams()
    params.max_tokens = 32
    params.temperature = 0.0
    params.stop = "###"  # one string, as the constructor takes it
    params.top_k = -1  # vLLM's "off"
    assert (params.max_tokens, params.temperature, params.stop, params.top_k) == (32, 0.0, ["###"], 0)
    assert params == SamplingParams(max_tokens=32, temperature=0.0, stop=["###"])
    assert params.greedy


@pytest.mark.parametrize("name,value", [("temperature", -1.0), ("top_p", 0.0), ("n", 0), ("stop", [""]),
                                        ("min_tokens", 100), ("temperature", float("inf")),
                                        ("repetition_penalty", float("inf")), ("presence_penalty", float("nan"))])
def test_a_refused_value_names_its_field_and_changes_nothing(name, value):
    params = SamplingParams(max_tokens=10)
    before = SamplingParams(max_tokens=10)
    with pytest.raises(SamplingParamsError) as refused:
        setattr(params, name, value)
    assert refused.value.param == name
    assert params == before


def test_an_unknown_field_is_refused():
    params = SamplingParams()
    with pytest.raises(AttributeError, match="no field 'max_new_tokens'"):
        params.max_new_tokens = 5  # type: ignore[attr-defined]


def test_clone_is_deep_and_a_pickled_copy_stays_checked():
    params = SamplingParams(stop=["a"], logit_bias={3: 1.0})
    twin = params.clone()
    twin.stop.append("b")
    twin.logit_bias[4] = 2.0
    twin.max_tokens = 3
    assert params.stop == ["a"] and params.logit_bias == {3: 1.0} and params.max_tokens == 16
    restored = pickle.loads(pickle.dumps(params))
    assert restored == params
    with pytest.raises(SamplingParamsError):
        restored.temperature = -2.0


@pytest.mark.parametrize("name,value", [("stop", 5), ("stop", {"a": 1}), ("stop_token_ids", 3)])
def test_a_stop_that_is_no_list_is_refused_by_name(name, value):
    with pytest.raises(SamplingParamsError) as refused:
        SamplingParams(**{name: value})
    assert refused.value.param == name
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
