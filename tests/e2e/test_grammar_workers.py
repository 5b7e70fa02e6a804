"""Grammar matchers in worker processes (`grammar_workers`): the same tokens as the engine's own thread (the
oracle: the in-thread backend, itself checked against jsonschema and a float64 reference in
test_structured_outputs.py), under sampling, n > 1, preemption, async scheduling and speculative decoding; the
outputs validate against their schemas; the workers' processes and shared memory go away with the backend; a
worker that dies fails the step with an error naming it."""

import json

import jsonschema
import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError
from kestrel.sampling_params import StructuredOutputsParams
from kestrel.structured.shards import GrammarShards

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "language": {"enum": ["python", "c", "rust"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "language", "age"],
    "additionalProperties": False,
}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 16,
          "maxItems": 40}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def params_mix() -> list[SamplingParams]:
    """Constrained requests on two schemas and a regex beside unconstrained ones, greedy and sampled."""
    out = []
    for seed, temperature in ((0, 0.0), (1, 0.9), (2, 1.3)):
        for spec in ({"json": PERSON, "disable_any_whitespace": True}, {"json": DIGITS},
                     {"regex": r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"}, None):
            out.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=48, structured_outputs=(
                StructuredOutputsParams(**spec) if spec is not None else None)))
    return out


def token_ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def check_valid(outputs, params) -> None:
    for out, p in zip(outputs, params):
        spec = p.structured_outputs
        for completion in out.outputs:
            if spec is None or completion.finish_reason != "stop":
                continue
            if spec.json is not None:
                jsonschema.validate(json.loads(completion.text), spec.json)


@pytest.mark.parametrize("engine_args", [
    {"async_scheduling": True},
    {"kv_cache_blocks": 10, "max_num_batched_tokens": 16, "max_num_seqs": 6, "enable_prefix_caching": False},
], ids=["async", "preemption"])
def test_workers_give_the_tokens_of_the_engine_thread(engine_args):
    prompts = ["A person, as JSON:\n", "digits = [1, 2, 3, 1, 2, 3]\nmore = ", "Email: ", "def f(x):\n"]
    prompts *= 2
    params = params_mix()[:len(prompts)]
    in_thread = LLM(max_model_len=160, grammar_workers=0, **engine_args)
    expected = in_thread.generate(prompts, params, use_tqdm=False)
    sharded = LLM(max_model_len=160, grammar_workers=2, **engine_args)
    outputs = sharded.generate(prompts, params, use_tqdm=False)
    assert isinstance(sharded.engine.structured, GrammarShards)
    assert token_ids(outputs) == token_ids(expected)
    assert [c.finish_reason for out in outputs for c in out.outputs] == \
        [c.finish_reason for out in expected for c in out.outputs]
    assert sum(c.finish_reason == "stop" for out in outputs for c in out.outputs) >= 2
    check_valid(outputs, params)
    if "kv_cache_blocks" in engine_args:
        assert sharded.stats.num_preemptions > 0
    backend = sharded.engine.structured
    assert not backend._shard_of and not backend._terminated  # every finished request's matcher released
    # n > 1 shares one grammar across siblings, each its own matcher
    n_params = params[1].replace(n=3)
    assert token_ids(sharded.generate(prompts[:1], n_params, use_tqdm=False)) == \
        token_ids(in_thread.generate(prompts[:1], n_params, use_tqdm=False))


def test_workers_under_speculative_decoding_keep_drafts_the_grammar_allows():
    prompt = "digits = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]\nmore = "
    params = [SamplingParams(temperature=t, seed=s, max_tokens=120, structured_outputs=StructuredOutputsParams(
        json=DIGITS, disable_any_whitespace=True)) for t, s in ((0.0, 0), (0.9, 1), (1.2, 2))]
    expected = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM, grammar_workers=0).generate(
        [prompt] * 3, params, use_tqdm=False)
    spec = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM, grammar_workers=2)
    outputs = spec.generate([prompt] * 3, params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(expected)
    assert spec.stats.num_spec_accepted_tokens > 0
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), DIGITS)


def test_a_worker_that_dies_fails_the_step_naming_it_and_closing_frees_everything():
    from multiprocessing.shared_memory import SharedMemory

    llm = LLM(max_model_len=128, grammar_workers=2)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=PERSON))
    llm.generate("x", params, use_tqdm=False)
    backend = llm.engine.structured
    processes = list(backend._finalizer.peek()[2][1])
    name = backend._memory.name
    assert all(p.is_alive() for p in processes)
    processes[1].kill()
    processes[1].join()
    with pytest.raises(RuntimeError, match="grammar worker 1 exited"):
        llm.generate(["x", "y"], params, use_tqdm=False)
    backend.close()
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(FileNotFoundError):
        SharedMemory(name=name)


def test_workers_start_with_the_engine_and_close_before_any_constrained_request():
    """The workers are forked when the engine is built (beside its load), wait for the vocabulary of the first
    constrained request, and exit at close without one."""
    from multiprocessing.shared_memory import SharedMemory

    llm = LLM(max_model_len=128, grammar_workers=2)
    backend = llm.engine.structured
    processes = list(backend._finalizer.peek()[2][1])
    name = backend._memory.name
    assert len(processes) == 2 and all(p.is_alive() for p in processes)
    out = llm.generate("x", SamplingParams(max_tokens=3), use_tqdm=False)  # unconstrained: the workers idle
    assert len(out[0].outputs[0].token_ids) == 3
    backend.close()
    assert not any(p.is_alive() for p in processes)
    assert all(p.exitcode == 0 for p in processes)
    with pytest.raises(FileNotFoundError):
        SharedMemory(name=name)


def test_a_negative_worker_count_is_refused():
    with pytest.raises(ConfigError, match="grammar_workers"):
        LLM(max_model_len=128, grammar_workers=-1)


UNGUARDED_SCRIPT = """
from kestrel import LLM, SamplingParams
from kestrel.sampling_params import StructuredOutputsParams

print("top level ran", flush=True)
llm = LLM(max_model_len=128, grammar_workers=2)
choice = StructuredOutputsParams(choice=["yes", "no"])
print("answer:", llm.generate("x", SamplingParams(max_tokens=8, structured_outputs=choice), use_tqdm=False)[0]
      .outputs[0].text, flush=True)
"""


def test_a_script_without_a_main_guard_runs_once_and_its_workers_constrain(tmp_path):
    """The workers start without the program's main module: a script with no `if __name__ == "__main__":` guard
    runs its top level once (not again in each worker, which would build the engine there) and gets its answer."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("top level ran") == 1, done.stdout
    assert done.stdout.splitlines()[-1] in ("answer: yes", "answer: no"), done.stdout
