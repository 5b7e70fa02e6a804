"""Sampling defaults and ranges have one source, SamplingParams: the request models and the command line's sampling
flags read it, and depart from it only where a named override says so."""

import dataclasses

import pytest

from kestrel.config import GENERATION_SAMPLING_KEYS
from kestrel.entrypoints import cli
from kestrel.entrypoints.chat import TOOL_FORMATS
from kestrel.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, parse_model
from kestrel.entrypoints.server_config import ServerConfig
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SAMPLING_BOUNDS, BeamSearchParams, SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Request fields that differ from SamplingParams' field of the same name on purpose: chat's max_tokens is
# unlimited (vLLM's: the model's remaining length), chat's logprobs is OpenAI's on/off switch (top_logprobs the
# count), completions' max_tokens also takes 0 (with echo: score the prompt; tested below).
DIFFERENT_BY_DESIGN = {(ChatCompletionRequest, "max_tokens"), (ChatCompletionRequest, "logprobs"),
                       (CompletionRequest, "max_tokens")}
# Request fields that set a SamplingParams field under another name.
RENAMED = {(ChatCompletionRequest, "max_completion_tokens"): "max_tokens",
           (ChatCompletionRequest, "top_logprobs"): "logprobs"}


def minimal(model: type) -> dict:
    return {"prompt": "x"} if model is CompletionRequest else {"messages": MESSAGES}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_request_defaults_are_sampling_params_defaults(model):
    checked = 0
    for name, info in model.model_fields.items():
        if name not in SAMPLING_FIELDS or (model, name) in DIFFERENT_BY_DESIGN:
            continue
        checked += 1
        if name in GENERATION_SAMPLING_KEYS or info.default is None:
            # Unset: the model's generation_config value, else SamplingParams' default (at conversion).
            assert info.default is None, name
        else:
            default = SamplingParams.default(name)
            assert type(info.default) is type(default) and info.default == default, name
    assert checked >= 15


def test_an_empty_request_samples_with_sampling_params_defaults():
    assert CompletionRequest(prompt="x").to_sampling_params() == SamplingParams()
    assert ChatCompletionRequest(messages=MESSAGES).to_sampling_params() == SamplingParams(max_tokens=None)
    nulls = {name: None for name in CompletionRequest.model_fields if name in SAMPLING_FIELDS}
    # max_tokens null is vLLM's "up to the context" (left out, it is 16).
    assert parse_model(CompletionRequest, {"prompt": "x", **nulls}).to_sampling_params() == SamplingParams(
        max_tokens=None)


def test_unset_fields_take_the_models_generation_config_then_sampling_params():
    model_defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    params = CompletionRequest(prompt="x", top_k=5).to_sampling_params(model_defaults)
    assert params == SamplingParams(temperature=0.6, top_p=0.9, top_k=5)


def test_beam_search_is_greedy_by_beam_search_params_default():
    assert BeamSearchParams(beam_width=2, max_tokens=4).temperature == SamplingParams.GREEDY_TEMPERATURE
    request = CompletionRequest(prompt="x", use_beam_search=True)
    assert request.beam_search_params(request.token_limit) == BeamSearchParams(
        beam_width=SamplingParams.default("n"), max_tokens=SamplingParams.default("max_tokens"))


def _probes(bound) -> list:
    """Values on both sides of each end of the bound."""
    step = 1 if bound.integer else 1e-3
    values = [None]
    for edge in (bound.ge, bound.gt, bound.le):
        if edge is not None:
            values += [edge - step, edge, edge + step]
    return [int(v) if bound.integer and v is not None else v for v in values]


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_request_fields_accept_exactly_sampling_params_range(model):
    bounded = [(name, name) for name in SAMPLING_BOUNDS if name in model.model_fields and (model, name) not in
               DIFFERENT_BY_DESIGN]
    bounded += [(field, name) for (owner, field), name in RENAMED.items() if owner is model]
    assert len(bounded) >= 10
    for field, name in bounded:
        bound = SAMPLING_BOUNDS[name]
        for value in _probes(bound):
            body = {**minimal(model), field: value}
            if model is ChatCompletionRequest and field == "top_logprobs":
                body["logprobs"] = True
            if value is None or bound.admits(value):
                parse_model(model, body)
                continue
            with pytest.raises(InvalidRequestError) as refused:
                parse_model(model, body)
            assert refused.value.param == field and str(refused.value).startswith(f"{field} must be "), (
                field, value, str(refused.value))


def test_cli_sampling_flags_default_to_sampling_params_but_for_the_named_overrides():
    defaults = cli.cli_sampling_defaults()
    overrides = {name: value for name, (value, _) in cli.CLI_SAMPLING_OVERRIDES.items()}
    assert set(overrides) <= set(defaults) <= SAMPLING_FIELDS
    for name, value in defaults.items():
        assert value == overrides.get(name, SamplingParams.default(name)), name
    assert overrides["temperature"] == SamplingParams.GREEDY_TEMPERATURE
    args = cli.build_parser().parse_args(["generate"])
    assert cli._sampling_params(args) == SamplingParams(**overrides)


def test_cli_sampling_flags_reach_sampling_params():
    args = cli.build_parser().parse_args(["chat", "--max-tokens", "5", "--temperature", "0.5", "--top-p", "0.9",
                                          "--top-k", "3", "--min-p", "0.1", "--repetition-penalty", "1.2",
                                          "--sample-seed", "7", "--stop", "a", "--stop", "b", "-n", "2",
                                          "--seed", "11"])
    assert cli._sampling_params(args) == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=3,
                                                        min_p=0.1, repetition_penalty=1.2, seed=7,
                                                        stop=["a", "b"], n=2)
    assert cli._engine_kwargs(args)["seed"] == 11  # the engine's seed, not the sampling seed


def test_the_cli_help_names_each_override_and_sampling_params_default():
    help_text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    for name, (value, reason) in cli.CLI_SAMPLING_OVERRIDES.items():
        assert f"(default: {value}: {reason}; SamplingParams() has {SamplingParams.default(name)})" in help_text


def test_one_tuple_of_tool_formats():
    tool_call_parser = next(f for f in dataclasses.fields(ServerConfig) if f.name == "tool_call_parser")
    assert tool_call_parser.metadata["choices"] is TOOL_FORMATS


def test_completion_max_tokens_takes_zero_and_otherwise_sampling_params_range():
    parse_model(CompletionRequest, {**minimal(CompletionRequest), "max_tokens": 0})
    for value in (-1, 2.5, True):
        with pytest.raises(InvalidRequestError) as refused:
            parse_model(CompletionRequest, {**minimal(CompletionRequest), "max_tokens": value})
        assert refused.value.param == "max_tokens"
