"""generation_config.json is honoured: its EOS ids end generation (and min_tokens holds them back), its sampling
settings are the defaults of requests that leave them unset; `generation_config="vllm"` ignores it, a directory
replaces it, and a bad value is a ConfigError."""

import json
import shutil

import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError, EngineConfig
from kestrel.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.sampling_params import SamplingParamsError

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen-config")
    write_tiny_checkpoint(str(path), arch="llama", seed=3)
    return path


def with_generation_config(model_dir, tmp_path, **fields):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    saved = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**saved, **fields}))
    return copy


def test_extra_eos_ids_stop_generation_and_min_tokens_holds_them_back(model_dir, tmp_path):
    plain = LLM(str(model_dir), dtype="float32", max_model_len=64)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    tokens = plain.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) == 8
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    stopper = tokens[2]
    extended = with_generation_config(model_dir, tmp_path, eos_token_id=[eos, stopper])
    llm = LLM(str(extended), dtype="float32", max_model_len=64)
    out = llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    first = tokens.index(stopper)
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(**GREEDY, min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert stopper not in held.token_ids[: first + 2]
    ignored = LLM(str(extended), dtype="float32", max_model_len=64, generation_config="vllm")
    assert ignored.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_sampling_defaults_apply_where_the_request_is_silent(model_dir, tmp_path):
    tuned = with_generation_config(model_dir, tmp_path, temperature=0.6, top_p=0.9, top_k=20)
    llm = LLM(str(tuned), dtype="float32", max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.9, 20)
    model_defaults = llm.engine.generation_defaults.sampling
    silent = CompletionRequest(prompt="hi").to_sampling_params(model_defaults)
    assert (silent.temperature, silent.top_p, silent.top_k) == (0.6, 0.9, 20)
    explicit = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=1.0,
                                     top_k=-1).to_sampling_params(model_defaults)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (1.0, 0.9, 0)  # -1 and 0: no top-k
    vllm = LLM(str(tuned), dtype="float32", max_model_len=64, generation_config="vllm")
    assert vllm.get_default_sampling_params().temperature == SamplingParams().temperature


def test_max_new_tokens_is_the_default_and_the_servers_cap(model_dir, tmp_path):
    """generation_config's max_new_tokens: offline, the default SamplingParams' max_tokens; on the server, the
    default and a cap of every request's max_tokens (vLLM's min of the two); a value that is no count is refused."""
    capped = with_generation_config(model_dir, tmp_path, max_new_tokens=4)
    llm = LLM(str(capped), dtype="float32", max_model_len=64)
    assert llm.get_default_sampling_params().max_tokens == 4
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 4
    model_defaults = llm.engine.generation_defaults.sampling
    messages = [{"role": "user", "content": "hi"}]
    assert CompletionRequest(prompt="hi").to_sampling_params(model_defaults).max_tokens == 4  # 16 left out
    assert CompletionRequest(prompt="hi", max_tokens=10).to_sampling_params(model_defaults).max_tokens == 4
    assert CompletionRequest(prompt="hi", max_tokens=2).to_sampling_params(model_defaults).max_tokens == 2
    assert ChatCompletionRequest(messages=messages).to_sampling_params(model_defaults).max_tokens == 4
    assert ChatCompletionRequest(messages=messages).to_sampling_params().max_tokens is None
    for bad in (0, "8", True):
        broken = with_generation_config(model_dir, tmp_path / str(bad), max_new_tokens=bad)
        with pytest.raises(ConfigError, match="max_new_tokens"):
            LLM(str(broken), dtype="float32", max_model_len=64)


def test_generation_config_from_another_directory_and_bad_values(model_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, generation_config=str(other))
    assert llm.get_default_sampling_params().temperature == 0.3
    with pytest.raises(ConfigError, match="generation_config"):
        EngineConfig.from_kwargs(str(model_dir), generation_config=str(tmp_path / "missing"))
    broken = with_generation_config(model_dir, tmp_path, eos_token_id="x")
    with pytest.raises(ConfigError, match="eos_token_id"):
        LLM(str(broken), dtype="float32", max_model_len=64)


def test_seed_minus_one_means_unseeded_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


def test_a_seed_outside_64_bits_is_refused_by_name():
    """torch's generators take 64-bit seeds: a larger one is refused when the params are made, not when a step
    seeds its generator (which would end the whole batch)."""
    assert SamplingParams(seed=(1 << 63) - 1).seed == (1 << 63) - 1 and SamplingParams(seed=-(1 << 63)).seed
    for seed in (1 << 63, 1 << 64, -(1 << 70)):
        with pytest.raises(SamplingParamsError, match="seed must be a 64-bit signed integer"):
            SamplingParams(seed=seed)


def test_the_siblings_of_the_largest_seed_keep_64_bit_seeds():
    from kestrel.sampling_params import sibling_seed

    top = (1 << 63) - 1
    assert [sibling_seed(top, i) for i in range(3)] == [top, -(1 << 63), -(1 << 63) + 1]
    assert sibling_seed(5, 2) == 7 and sibling_seed(None, 3) is None
    llm = LLM(dtype="float32", max_model_len=64)
    outs = llm.generate("a", SamplingParams(seed=top, n=2, max_tokens=4, temperature=1.0), use_tqdm=False)
    assert len(outs[0].outputs) == 2
