"""`kestrel.AsyncLLM` embedded in a small asyncio application: concurrent requests stream their tokens, a cancelled
task and an abort by id free their requests, final-only output, and a clean shutdown."""

import asyncio

import pytest

from kestrel import AsyncLLM, SamplingParams
from kestrel.entrypoints.async_engine import EngineDeadError
from kestrel.loader.model_init import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("async-llm")
    write_tiny_checkpoint(str(path), arch="llama", seed=2)
    return str(path)


# A reader that falls behind gets merged deltas, so "more than one output per stream" needs the cores to itself:
# run alone, after the rest (`make test`).
@pytest.mark.serial
def test_an_asyncio_app_streams_cancels_aborts_and_shuts_down(model_dir):
    async def app() -> None:
        llm = AsyncLLM(model_dir, dtype="float32", max_model_len=128, max_num_seqs=8)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

        async def collect(i: int) -> tuple[list[int], str, int]:
            deltas, text, steps = [], "", 0
            async for out in llm.generate({"prompt_token_ids": [3 + i, 4, 5]}, greedy, request_id=f"r{i}"):
                deltas += out.outputs[0].delta_token_ids
                text, steps = out.outputs[0].text, steps + 1
            assert out.finished and deltas == out.outputs[0].token_ids
            return deltas, text, steps

        results = await asyncio.gather(*(collect(i) for i in range(4)))
        assert all(len(tokens) == 12 and steps > 1 for tokens, _, steps in results)

        final_only = greedy.replace(output_kind="final_only")
        outs = [o async for o in llm.generate({"prompt_token_ids": [3, 4, 5]}, final_only)]
        assert len(outs) == 1 and outs[0].outputs[0].token_ids == results[0][0]

        long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        streaming = asyncio.Event()

        async def until_cancelled() -> None:
            async for _ in llm.generate("hello", long, request_id="cancel-me"):
                streaming.set()
                await asyncio.sleep(0)  # the cancellation lands here, mid-stream

        task = asyncio.create_task(until_cancelled())
        await streaming.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        stream = llm.generate("hello", long, request_id="abort-me")
        first = await stream.__anext__()
        assert not first.finished
        await llm.abort("abort-me")
        await stream.aclose()
        for _ in range(100):
            if not llm.engine.core.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        assert not llm.engine.core.has_unfinished_requests()
        await llm.check_health()
        llm.shutdown()
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            await llm.check_health()

    asyncio.run(app())


def test_llm_generate_builds_its_bar_with_a_given_tqdm_class(model_dir):
    from tqdm import tqdm

    from kestrel import LLM

    made = []

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = False
            super().__init__(*args, **kwargs)
            made.append(self)

    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    llm.generate([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [5, 6]}],
                 SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=Bar)
    assert len(made) == 1 and made[0].n == 2 and "output:" in made[0].postfix


def test_cumulative_logprob_sums_the_generated_tokens(model_dir):
    from kestrel import LLM

    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    prompt = {"prompt_token_ids": [3, 4, 5]}
    out = llm.generate(prompt, SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.cumulative_logprob == sum(step[t].logprob for t, step in zip(c.token_ids, c.logprobs)) < 0
    plain = llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None


def test_bad_words_are_never_generated(model_dir):
    from kestrel import LLM

    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    prompt = {"prompt_token_ids": [3, 4, 5]}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    sequences = {t: llm.engine._bad_word_sequences([llm.tokenizer.decode([t]).strip()]) for t in set(tokens)}
    banned = next(t for t in tokens if [t] in sequences[t])  # a generated token that is a word on its own
    word = llm.tokenizer.decode([banned]).strip()
    out = llm.generate(prompt, greedy.replace(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    assert banned not in out and len(out) == 8


def test_priority_scheduling_serves_lower_values_first(model_dir):
    from kestrel import LLM
    from kestrel.request import InvalidRequestError

    llm = LLM(model_dir, dtype="float32", max_model_len=64, max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outputs = llm.generate(["a b", "c d", "e f"], params, priority=[2, 0, 1], use_tqdm=False)
    order = sorted(range(3), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]
    fcfs = LLM(model_dir, dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'") as refused:
        fcfs.generate(["a"], params, priority=[1], use_tqdm=False)
    assert refused.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="LoRA") as lora:
        fcfs.generate(["a"], params, lora_request=object(), use_tqdm=False)
    assert lora.value.param == "lora_request"
    assert not fcfs.engine.has_unfinished_requests()


def test_async_llm_takes_a_priority(model_dir):
    async def app() -> list[str]:
        async with AsyncLLM(model_dir, dtype="float32", max_model_len=64, max_num_seqs=1,
                            scheduling_policy="priority") as engine:
            finished: list[str] = []
            seated = asyncio.Event()

            async def run(name: str, priority: int, max_tokens: int = 4) -> None:
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                async for out in engine.generate("x y", params, name, priority=priority):
                    seated.set()
                    if out.finished:
                        finished.append(name)

            # "first" holds the one seat, with tokens enough left that both others wait behind it however slow
            # the machine: their order is then the policy's, not their arrival's
            first = asyncio.create_task(run("first", 0, max_tokens=48))
            await asyncio.wait_for(seated.wait(), 60)
            await asyncio.gather(first, run("low", 9), run("high", -5))
            return finished

    finished = asyncio.run(app())
    assert finished.index("high") < finished.index("low")


def test_an_abort_while_the_prompt_is_being_prepared_ends_the_request(model_dir):
    """`abort` right after `generate` starts, while its prompt is still being tokenized (before the engine has the
    request), ends it as soon as it is submitted: its stream closes with finish_reason "abort", it does not run
    its 300 tokens."""
    async def app():
        async with AsyncLLM(model_dir, dtype="float32", max_model_len=512) as engine:
            params = SamplingParams(max_tokens=300, ignore_eos=True)

            async def consume():
                return [out async for out in engine.generate("a long enough prompt", params, "early")]

            task = asyncio.create_task(consume())
            await asyncio.sleep(0)  # the request is preparing its prompt in a worker thread
            assert "early" in engine._preparing
            await engine.abort("early")
            outputs = await asyncio.wait_for(task, 60)
            again = [out async for out in engine.generate("a long enough prompt", SamplingParams(max_tokens=3),
                                                          "early")]
            return outputs, again

    outputs, again = asyncio.run(app())
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and final.finish_reason == "abort" and len(final.token_ids) < 300
    assert again[-1].finished and again[-1].outputs[0].finish_reason == "length"  # the id is free again

def test_async_llm_from_vllms_engine_args_logs_requests_and_awaits_its_tokenizer(model_dir, caplog):
    """vLLM's spelling: `AsyncLLM.from_engine_args(AsyncEngineArgs(...))`, `enable_log_requests`, and an awaited
    `get_tokenizer()`; an unknown engine argument is refused by name when the engine is built."""
    import logging

    from kestrel import AsyncEngineArgs, ConfigError

    async def app() -> tuple[list[int], str]:
        args = AsyncEngineArgs(model=model_dir, dtype="float32", max_model_len=64, enable_log_requests=True)
        async with AsyncLLM.from_engine_args(args) as engine:
            tokenizer = await engine.get_tokenizer()
            outputs = [out async for out in engine.generate("hello", SamplingParams(max_tokens=2), "logged")]
            return tokenizer.encode("hello"), outputs[-1].prompt_token_ids

    with caplog.at_level(logging.INFO, logger="kestrel.entrypoints.async_llm"):
        ids, prompt_ids = asyncio.run(app())
    assert ids == prompt_ids
    assert any("request logged" in record.getMessage() for record in caplog.records)
    with pytest.raises(ConfigError, match="max_model_length"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(model_dir, max_model_length=64))
    with pytest.raises(ConfigError, match="contradict"):
        AsyncLLM(model_dir, enable_log_requests=True, disable_log_requests=True)

def test_async_llm_resets_its_prefix_cache_between_requests(model_dir):
    """vLLM's `await AsyncLLM.reset_prefix_cache()`: applied by the engine thread before its next step; a repeated
    prompt then computes again."""
    from kestrel.inputs import TokensPrompt

    async def app() -> tuple[list[int], bool]:
        async with AsyncLLM(model_dir, dtype="float32", max_model_len=128) as engine:
            prompt = TokensPrompt(prompt_token_ids=list(range(10, 60)))

            async def cached(name: str) -> int:
                outputs = [out async for out in engine.generate(prompt, SamplingParams(max_tokens=1), name)]
                return outputs[-1].num_cached_tokens

            counts = [await cached("first"), await cached("again")]
            reset = await engine.reset_prefix_cache()
            counts.append(await cached("after"))
            return counts, reset

    counts, reset = asyncio.run(app())
    assert reset and counts == [0, 48, 0]

def test_shortest_prefill_serves_short_prompts_first_with_the_same_answers(model_dir):
    from kestrel import LLM

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 5, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model_dir, dtype="float32", max_model_len=64, max_num_seqs=1, scheduling_policy="shortest_prefill")
    outputs = llm.generate(prompts, params, priority=[0, 0, 0], use_tqdm=False)
    order = sorted(range(3), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]
    fcfs = LLM(model_dir, dtype="float32", max_model_len=64, max_num_seqs=1).generate(prompts, params,
                                                                                      use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in fcfs]


def test_prompt_dicts_are_read_whole_or_refused(model_dir):
    """A text model refuses multi_modal_data, and an unknown prompt key is refused by name (LLM and AsyncLLM alike),
    never dropped."""
    from PIL import Image

    from kestrel import LLM
    from kestrel.request import InvalidRequestError

    image = {"prompt": "Describe:", "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}
    salted = {"prompt": "hi", "mm_processor_kwargs": {}}
    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    for prompt, param in ((image, "multi_modal_data"), (salted, "mm_processor_kwargs")):
        with pytest.raises(InvalidRequestError) as error:
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
        assert error.value.param == param

    async def app() -> None:
        allm = AsyncLLM(model_dir, dtype="float32", max_model_len=128)
        try:
            for prompt, param in ((image, "multi_modal_data"), (salted, "mm_processor_kwargs")):
                with pytest.raises(InvalidRequestError) as error:
                    async for _ in allm.generate(prompt, SamplingParams(max_tokens=2)):
                        pass
                assert error.value.param == param
        finally:
            allm.shutdown()

    asyncio.run(app())


def test_token_prompts_take_any_sequence_of_integers(model_dir):
    """vLLM's TokensPrompt form (`kestrel.inputs`): its ids as a list, a tuple or numpy / torch integers give the
    same output; ids that are not integers are refused by name."""
    import numpy as np
    import torch

    from kestrel import LLM
    from kestrel.inputs import TextPrompt, TokensPrompt
    from kestrel.request import InvalidRequestError

    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = llm.get_tokenizer().encode("once upon a time")
    forms = [TokensPrompt(prompt_token_ids=ids), TokensPrompt(prompt_token_ids=tuple(ids)),
             TokensPrompt(prompt_token_ids=np.array(ids)), TokensPrompt(prompt_token_ids=torch.tensor(ids))]
    outputs = llm.generate(forms + [TextPrompt(prompt="once upon a time")], params, use_tqdm=False)
    assert all(out.prompt_token_ids == ids for out in outputs)
    assert len({tuple(out.outputs[0].token_ids) for out in outputs}) == 1
    for bad in ([1.5, 2.0], "12", 7):
        with pytest.raises(InvalidRequestError) as error:
            llm.generate(TokensPrompt(prompt_token_ids=bad), params, use_tqdm=False)
        assert error.value.param == "prompt_token_ids"

def test_a_cache_salt_shares_cached_blocks_only_with_its_own_salt(model_dir):
    """vLLM's `cache_salt` prompt key: the first block's hash carries it, so a salted prompt finds in the prefix cache
    only what prompts of the same salt computed (an unsalted one only unsalted blocks); generate and the pooling
    methods take it, beam_search refuses it, and an empty salt is refused by name."""
    from kestrel import LLM
    from kestrel.inputs import TokensPrompt
    from kestrel.request import InvalidRequestError

    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=1)
    ids = list(range(10, 60))  # three full blocks of 16 can come from the cache

    def cached(salt: str | None) -> int:
        prompt = TokensPrompt(prompt_token_ids=ids) if salt is None else TokensPrompt(prompt_token_ids=ids,
                                                                                      cache_salt=salt)
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    assert [cached(s) for s in ("a", "a", "b", None, None, "b")] == [0, 48, 0, 0, 48, 48]
    with pytest.raises(InvalidRequestError) as empty:
        llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt=""), params, use_tqdm=False)
    assert empty.value.param == "cache_salt"
    from kestrel.sampling_params import BeamSearchParams

    with pytest.raises(InvalidRequestError) as beam:
        llm.beam_search([TokensPrompt(prompt_token_ids=ids, cache_salt="a")], BeamSearchParams(beam_width=2,
                                                                                               max_tokens=2))
    assert beam.value.param == "cache_salt"

def test_generate_names_a_wrong_argument(model_dir):
    from kestrel import LLM
    from kestrel.request import InvalidRequestError

    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    for args, param in (((None,), "prompts"), (("a", {"max_tokens": 3}), "sampling_params"),
                        ((["a", "b"], [SamplingParams(max_tokens=1), "x"]), "sampling_params")):
        with pytest.raises(InvalidRequestError) as error:
            llm.generate(*args, use_tqdm=False)
        assert error.value.param == param
        if isinstance(args[-1], dict):
            assert "got dict" in str(error.value)  # the dict named, not one of its keys
    # a generator of SamplingParams is a list of them
    outs = llm.generate(["a", "b"], (SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 2)), use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outs] == [1, 2]


def test_llm_chat_takes_vllms_template_arguments(model_dir):
    """continue_final_message, chat_template_kwargs and chat_template_content_format reach the template; each
    output's prompt is its rendered conversation, whose tokens are its prompt_token_ids."""
    from kestrel import LLM
    from kestrel.request import InvalidRequestError

    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    template = ("{{ greeting | default('') }}{% for m in messages %}[{{ m.role }}:"
                "{{ m.content if m.content is string else 'parts' }}]{% endfor %}"
                "{% if add_generation_prompt %}[assistant:{% endif %}")
    params = SamplingParams(max_tokens=2, temperature=0.0)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    (out,) = llm.chat(chat, params, use_tqdm=False, chat_template=template, add_generation_prompt=False,
                      continue_final_message=True, chat_template_kwargs={"greeting": "!"})
    assert out.prompt == "![user:Hi][assistant:Hello"  # the assistant's message left open
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    (parts,) = llm.chat(chat[:1], params, use_tqdm=False, chat_template=template,
                        chat_template_content_format="openai")
    assert parts.prompt == "[user:parts][assistant:"
    with pytest.raises(InvalidRequestError) as error:
        llm.chat(chat, params, use_tqdm=False, continue_final_message=True)
    assert error.value.param == "continue_final_message"  # it needs add_generation_prompt=False
    with pytest.raises(InvalidRequestError) as error:
        llm.chat(chat, params, use_tqdm=False, chat_template_content_format="xml")
    assert error.value.param == "chat_template_content_format"


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(model_dir):
    from kestrel import LLM

    llm = LLM(model_dir, dtype="float32", max_model_len=128, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    fresh = llm.generate(prompt, params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == first.outputs[0].token_ids


def test_truncate_prompt_tokens_in_sampling_params_keeps_the_prompts_last_tokens(model_dir):
    """vLLM's SamplingParams(truncate_prompt_tokens=N): the request runs on the prompt's last N tokens (-1: as many
    as max_model_len), exactly as that shorter prompt would; LLM and AsyncLLM alike."""
    from kestrel import LLM
    from kestrel.request import InvalidRequestError
    from kestrel.sampling_params import SamplingParamsError

    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    prompt = list(range(3, 23))
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    short = llm.generate({"prompt_token_ids": prompt[-6:]}, greedy, use_tqdm=False)[0]
    cut = llm.generate({"prompt_token_ids": prompt}, greedy.replace(truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-6:] and cut.outputs[0].token_ids == short.outputs[0].token_ids
    text = llm.generate("a b c", greedy.replace(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert text.prompt == "a b c"  # nothing cut: the text is still the prompt
    assert llm.generate("a b c d e f g", greedy.replace(truncate_prompt_tokens=2), use_tqdm=False)[0].prompt is None
    for bad in (0, -2, 1.5, True):
        with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(InvalidRequestError, match="max_model_len=64") as refused:
        llm.generate("x", greedy.replace(truncate_prompt_tokens=65), use_tqdm=False)
    assert refused.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequestError, match="already cut"):
        llm.engine.add_request("direct", prompt, greedy.replace(truncate_prompt_tokens=6))
    assert not llm.engine.has_unfinished_requests()

    async def app() -> list[int]:
        allm = AsyncLLM(model_dir, dtype="float32", max_model_len=64)
        try:
            outs = [o async for o in allm.generate({"prompt_token_ids": prompt},
                                                   greedy.replace(truncate_prompt_tokens=6, output_kind="final_only"))]
            assert outs[-1].prompt_token_ids == prompt[-6:]
            return outs[-1].outputs[0].token_ids
        finally:
            allm.shutdown()

    assert asyncio.run(app()) == short.outputs[0].token_ids


def test_detokenize_false_gives_token_ids_only(model_dir):
    """vLLM's SamplingParams(detokenize=False): the same tokens, no text, no logprob token texts; stop strings,
    which need the text, are refused with it."""
    from kestrel import LLM
    from kestrel.sampling_params import SamplingParamsError

    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    for kind in ("cumulative", "final_only"):
        texts = llm.generate("a b c", greedy.replace(output_kind=kind), use_tqdm=False)[0].outputs[0]
        ids = llm.generate("a b c", greedy.replace(output_kind=kind, detokenize=False), use_tqdm=False)[0].outputs[0]
        assert ids.token_ids == texts.token_ids and texts.text and ids.text == ""
        assert all(entry[t].decoded_token is None for t, entry in zip(ids.token_ids, ids.logprobs))
        assert all(entry[t].decoded_token is not None for t, entry in zip(texts.token_ids, texts.logprobs))
    with pytest.raises(SamplingParamsError, match="detokenize=False"):
        SamplingParams(detokenize=False, stop=["x"])
    with pytest.raises(SamplingParamsError, match="detokenize"):
        SamplingParams(detokenize="no")
