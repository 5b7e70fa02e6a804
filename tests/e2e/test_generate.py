"""End to end on CPU: greedy generation matches HF transformers, also under chunking, preemption and prefix caching."""

import random

import pytest
import torch
import transformers

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SamplingParamsError

MAX_NEW = 10


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(str(path), arch=request.param, seed=1)
    return str(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-e2e")
    write_tiny_checkpoint(str(path), arch="llama", seed=2)
    return str(path)


def mixed_prompts(vocab_size: int, count: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def kestrel_greedy(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_hf_for_each_architecture(checkpoint):
    llm = LLM(checkpoint, dtype="float32", max_model_len=128)
    prompts = mixed_prompts(llm.runner.vocab_size)
    assert kestrel_greedy(llm, prompts) == hf_greedy(checkpoint, prompts)


def test_forced_chunking_and_preemption_keep_outputs(llama_dir):
    prompts = mixed_prompts(1000, seed=3)
    expected = hf_greedy(llama_dir, prompts)
    chunked = LLM(llama_dir, dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=8)
    assert kestrel_greedy(chunked, prompts) == expected
    assert chunked.stats.num_steps > sum(len(p) for p in prompts) // 8
    tight = LLM(llama_dir, dtype="float32", max_model_len=64, kv_cache_blocks=6, max_num_seqs=16)
    assert kestrel_greedy(tight, prompts) == expected
    assert tight.stats.num_preemptions > 0
    pool = tight.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_seeded_request_samples_the_same_tokens_when_preempted(llama_dir, async_scheduling):
    """A preempted seeded request's generator goes on where it was when the request runs again (a new one from the
    seed replayed its first draws): each request samples what it samples alone, one at a time."""
    prompts = mixed_prompts(1000, seed=3)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts))]
    requests = [{"prompt_token_ids": p} for p in prompts]
    roomy = LLM(llama_dir, dtype="float32", max_model_len=64, max_num_seqs=1, async_scheduling=async_scheduling)
    alone = [o.outputs[0].token_ids for o in roomy.generate(requests, params, use_tqdm=False)]
    tight = LLM(llama_dir, dtype="float32", max_model_len=64, kv_cache_blocks=6, max_num_seqs=16,
                async_scheduling=async_scheduling)
    together = [o.outputs[0].token_ids for o in tight.generate(requests, params, use_tqdm=False)]
    assert tight.stats.num_preemptions > 0
    assert together == alone
    assert not tight.runner.step_inputs.preempted_generators  # each came back, or finished


def test_prefix_caching_computes_fewer_tokens_with_identical_outputs(llama_dir):
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(48)]
    first = [shared + [rng.randrange(3, 1000) for _ in range(5)] for _ in range(4)]
    second = [shared + [rng.randrange(3, 1000) for _ in range(7)] for _ in range(4)]

    def scheduled_for_second(enable: bool) -> tuple[int, list[list[int]]]:
        llm = LLM(llama_dir, dtype="float32", max_model_len=128, enable_prefix_caching=enable)
        kestrel_greedy(llm, first)
        before = llm.stats.num_scheduled_tokens
        outputs = kestrel_greedy(llm, second)
        return llm.stats.num_scheduled_tokens - before, outputs

    cached_tokens, cached_outputs = scheduled_for_second(True)
    plain_tokens, plain_outputs = scheduled_for_second(False)
    assert cached_outputs == plain_outputs
    assert cached_tokens <= plain_tokens - 4 * 48


def test_sampling_is_seeded_per_request(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=123, ignore_eos=True)
    alone = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["something else", "hello world", "a third"],
                         [SamplingParams(temperature=1.0, max_tokens=8), params, SamplingParams(max_tokens=3)],
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


def test_n_logprobs_and_stop_strings(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_model_len=128)
    out = llm.generate("def f(x):", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=2,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert len(completion.token_ids) == 6 and len(completion.logprobs) == 6
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert token_id in entry and 2 <= len(entry) <= 3
            assert all(lp.logprob <= 0.0 for lp in entry.values())
            # The top candidates are ranked 1, 2 (vLLM's Logprob.rank), each with its text decoded alone.
            others = sorted(lp.rank for t, lp in entry.items() if t != token_id or lp.rank <= 2)
            assert others[:2] == [1, 2] and entry[token_id].rank >= 1
            assert all(lp.decoded_token == llm.tokenizer.decode([t]) for t, lp in entry.items())
    greedy = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop = greedy.text[3:6]
    assert stop, "the greedy completion is too short to pick a stop string from"
    stopped = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == greedy.text[: greedy.text.index(stop)]


def test_bad_input_errors(llama_dir, tmp_path):
    llm = LLM(llama_dir, dtype="float32", max_model_len=32)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_model_len=32"):
        llm.generate({"prompt_token_ids": [5] * 40}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_logprobs=20"):  # vLLM's default limit
        llm.generate("x", SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-0.5)
    for top_p in (0.0, 1.5):
        with pytest.raises(SamplingParamsError, match="top_p"):
            SamplingParams(top_p=top_p)
    with pytest.raises(ConfigError, match="no such directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(llama_dir, max_num_seqs=0)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        LLM(llama_dir, max_num_seq=4)
    # The engine still works after rejected requests, and nothing leaked.
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    assert not llm.engine.has_unfinished_requests()


def test_prompt_logprobs_match_hf_under_chunking(llama_dir):
    prompts = mixed_prompts(1000, count=4, seed=9)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    llm = LLM(llama_dir, dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=8)
    params = SamplingParams(max_tokens=1, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        with torch.inference_mode():
            expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            token = prompt[position]
            row = expected[position - 1]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            # Its rank in the float64 distribution, up to ties within the float32 tolerance.
            chosen = row[token].item()
            assert 1 + int((row > chosen + 1e-4).sum()) <= entry[token].rank <= 1 + int((row > chosen - 1e-4).sum())
            top3 = row.topk(3).indices.tolist()
            assert set(top3) <= set(entry)


def test_fp8_kv_cache_uses_checkpoint_scales(tmp_path):
    from safetensors.torch import load_file, save_file

    write_tiny_checkpoint(str(tmp_path), arch="llama", seed=4)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(weights, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, kv_cache_dtype="fp8")
    layers = llm.runner.model.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers[:2]] == [(0.5, 1.0), (1.0, 0.25)]
    assert llm.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    prompts = mixed_prompts(1000, count=4, seed=11)
    fp8 = kestrel_greedy(llm, prompts, max_new=4)
    assert all(len(tokens) == 4 for tokens in fp8)
