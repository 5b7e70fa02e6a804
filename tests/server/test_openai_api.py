"""The real server on the tiny random Llama, driven by the official `openai` client."""

import openai
import pytest
from http_client import HTTP
from transformers import AutoTokenizer

PROMPT = "The quick brown fox"
MODEL = "tiny"


@pytest.fixture(scope="module", params=["engine_thread", "engine_core_process"])
def served(request, openai_server):
    """Every test here runs on both engines: the engine core on a thread, and in its own process."""
    return openai_server if request.param == "engine_thread" else request.getfixturevalue("core_process_server")


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served.client()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_completion_usage_matches_the_tokenizer(client, hf_tokenizer):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0.0, extra_body={
        "ignore_eos": True})
    choice = response.choices[0]
    assert response.object == "text_completion" and response.model == MODEL
    assert choice.finish_reason == "length" and choice.index == 0
    assert response.usage.prompt_tokens == len(hf_tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7
    assert isinstance(choice.text, str) and choice.text


def test_streamed_completion_equals_the_whole_one(client):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_chunks_leave_null_fields_out_but_each_choice_has_its_finish_reason_and_logprobs(served, path):
    """A chunk is written without its null fields (the usage chunk too), except a choice's `finish_reason` and
    `logprobs`, null until they have a value, as OpenAI's and vLLM's chunks carry them."""
    import json

    body = {"model": MODEL, "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})}
    reply = HTTP.post(f"{served.base_url}{path}", headers=served.headers, json=body)
    chunks = [json.loads(line[len("data: "):]) for line in reply.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    nulls = [key for chunk in chunks for key, value in chunk.items() if value is None]
    assert not nulls, nulls
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    assert choices and all("finish_reason" in c and "logprobs" in c for c in choices), choices
    assert [c["finish_reason"] for c in choices if c["finish_reason"] is not None] == ["length"]
    assert all(c["logprobs"] is None for c in choices)
    always = ("finish_reason", "logprobs") + (("stop_reason",) if path == "/v1/completions" else ())
    assert all(key in c for c in choices for key in always)
    assert not [key for c in choices for key, value in c.items() if value is None and key not in always]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (guidellm's default streaming request), completions and chat."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    args = {"model": MODEL, "max_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    completion = list(client.completions.create(prompt=PROMPT, stream=True, stream_options=options, **args))
    messages = [{"role": "user", "content": "Hello"}]
    chat = list(client.chat.completions.create(messages=messages, stream=True, stream_options=options, **args))
    for chunks in (completion, chat):
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 6
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        assert chunks[-1].choices == []  # the usage chunk include_usage asks for still closes the stream
    plain = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **args))
    assert all(c.usage is None for c in plain[:-1])


def test_continuous_usage_counts_each_chunks_own_choice_and_prompt(client, hf_tokenizer):
    """With n > 1 and several prompts, a chunk's usage is its own choice's tokens so far and its own prompt's tokens
    (as vLLM counts them); the closing usage chunk counts every choice."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    args = {"model": MODEL, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3,
            "extra_body": {"ignore_eos": True}}
    prompts = ["Hello", "Once upon a time there was"]
    lengths = [len(hf_tokenizer.encode(p)) for p in prompts]
    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options=options, **args))
    seen: dict[int, int] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert chunk.usage.prompt_tokens == lengths[choice.index // 2]
        assert chunk.usage.completion_tokens >= seen.get(choice.index, 0)
        seen[choice.index] = chunk.usage.completion_tokens
    assert seen == {0: 5, 1: 5, 2: 5, 3: 5}
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == sum(lengths)
    chat = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], stream=True,
                                               stream_options=options, **args))
    finals = {c.choices[0].index: c.usage.completion_tokens for c in chat if c.choices and c.choices[0].finish_reason}
    assert finals == {0: 5, 1: 5} and chat[-1].usage.completion_tokens == 10

def test_cache_salt_is_taken_and_an_empty_one_refused(served):
    """vLLM's cache_salt reaches the engine (thread and core process alike; its effect on the prefix cache:
    tests/server/test_vllm_parity.py); an empty salt is a 400 naming it."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}), ("/v1/chat/completions", chat)):
        ok = HTTP.post(f"{served.base_url}{path}", headers=served.headers,
                       json={"model": MODEL, **body, "cache_salt": "tenant-a"})
        assert ok.status_code == 200, ok.text
        empty = HTTP.post(f"{served.base_url}{path}", headers=served.headers,
                          json={"model": MODEL, **body, "cache_salt": ""})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt", empty.text

def test_n_samples_and_several_prompts(client):
    response = client.completions.create(model=MODEL, prompt=["Hello", "Once upon a time"], n=3, max_tokens=4,
                                         temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == list(range(6))
    assert response.usage.completion_tokens == 6 * 4
    texts = [c.text for c in response.choices[:3]]
    assert len(set(texts)) > 1, "seeded siblings must not repeat each other"
    again = client.completions.create(model=MODEL, prompt=["Hello", "Once upon a time"], n=3, max_tokens=4,
                                      temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in response.choices]


def test_completion_logprobs(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
        # Greedy: the sampled token is the most likely one.
        assert logprob == pytest.approx(max(top.values()))


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {base!r}"
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0, stop=[stop],
                                       extra_body={"ignore_eos": True}).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == base[: base.index(stop)]
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == base[: base.index(stop) + len(stop)]


def test_echo_and_token_id_prompts(client, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0.0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


def test_chat_usage_and_streaming(client, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                              temperature=0.0, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert response.usage.prompt_tokens == len(hf_tokenizer.encode(rendered, add_special_tokens=False))
    assert response.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                            temperature=0.0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.prompt_tokens == response.usage.prompt_tokens


def test_chat_logprobs_and_content_parts(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True,
                                              top_logprobs=2, temperature=0.0, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1]
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy
    joined = b"".join(bytes(item.bytes) for item in content)
    assert joined.decode("utf-8", errors="replace") == response.choices[0].message.content


def test_chat_logprob_bytes_rebuild_characters_split_across_tokens(client):
    """A token holding part of a character reads as U+FFFD alone; its `bytes` are its own, so the content's bytes
    are the tokens' bytes joined (OpenAI's reason for the field)."""
    messages = [{"role": "user", "content": "Write it."}, {"role": "assistant", "content": 'x = "\u00e9\u00e8\u4e2d'}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, logprobs=True, temperature=0.0,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    content = response.choices[0].logprobs.content
    assert any(item.token == "\ufffd" for item in content)  # the random model's output splits characters
    joined = b"".join(bytes(item.bytes) for item in content)
    assert joined.decode("utf-8", errors="replace") == response.choices[0].message.content


def test_models_tokenize_detokenize(client, served, hf_tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    url, headers = served.base_url, served.headers
    tokens = HTTP.post(f"{url}/tokenize", json={"model": MODEL, "prompt": PROMPT}, headers=headers).json()
    assert tokens["tokens"] == hf_tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 256
    chat = HTTP.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=headers)
    assert chat.status_code == 200 and chat.json()["count"] > 3
    # The prompt a chat request continuing the assistant's message runs: the template's, left open.
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    opened = HTTP.post(f"{url}/tokenize", json={"messages": turns, "add_generation_prompt": False,
                                                "continue_final_message": True}, headers=headers).json()["tokens"]
    rendered = hf_tokenizer.apply_chat_template(turns, tokenize=False, continue_final_message=True)
    assert opened == hf_tokenizer.encode(rendered, add_special_tokens=False)
    refused = HTTP.post(f"{url}/tokenize", json={"messages": turns, "continue_final_message": True}, headers=headers)
    assert refused.status_code == 400 and "continue_final_message" in refused.json()["error"]["message"]
    text = HTTP.post(f"{url}/detokenize", json={"tokens": tokens["tokens"][1:]}, headers=headers).json()
    assert text["prompt"] == PROMPT
    # vLLM's add_special_tokens on the chat form: the tokenizer's BOS on top of the template's tokens.
    plain = HTTP.post(f"{url}/tokenize", json={"messages": turns[:1]}, headers=headers).json()["tokens"]
    added = HTTP.post(f"{url}/tokenize", json={"messages": turns[:1], "add_special_tokens": True},
                      headers=headers).json()["tokens"]
    bos = hf_tokenizer.encode("x")[:-len(hf_tokenizer.encode("x", add_special_tokens=False))]
    assert bos and added == bos + plain
    # A chat-form body's errors name its own fields, not the completion form's prompt.
    for body, param in (({"messages": "hi"}, "messages"), ({"messages": turns, "chat_template_kwargs": "x"},
                                                            "chat_template_kwargs")):
        bad = HTTP.post(f"{url}/tokenize", json=body, headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.json()


def test_health_version_and_metric_names(client, served):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    url = served.base_url
    assert HTTP.get(f"{url}/health").status_code == 200
    assert HTTP.get(f"{url}/version").json()["version"]
    samples = served.metrics()
    # vLLM's series (vllm/v1/metrics/loggers.py), under both prefixes, with the same values.
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
             "request_success_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
             "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
             "request_queue_time_seconds_count", "request_prefill_time_seconds_count",
             "request_decode_time_seconds_count", "request_inference_time_seconds_count",
             "request_prompt_tokens_count", "request_generation_tokens_count", "request_params_n_count",
             "request_params_max_tokens_count", "cache_config_info", "iteration_tokens_total_count")
    for name in names:
        assert f"kestrel:{name}" in samples and f"vllm:{name}" in samples, name
        assert samples[f"kestrel:{name}"] == samples[f"vllm:{name}"], name
    assert samples["vllm:generation_tokens_total"] >= 3
    assert samples["vllm:request_prefill_time_seconds_count"] >= 1
    assert samples["vllm:iteration_tokens_total_sum"] >= samples["vllm:generation_tokens_total"]
    text = HTTP.get(f"{url}/metrics", headers=served.headers).text
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"}' in text
    for reason in ("stop", "length", "abort"):  # every finish reason's series, as vLLM creates them at start
        assert f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="tiny"}}' in text
    assert 'block_size="16"' in text


def test_logit_bias_forces_and_bans_tokens(client, hf_tokenizer):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(logprobs=0, **args).choices[0]
    forced_id = 7
    forced = client.completions.create(logit_bias={str(forced_id): 100}, **args).choices[0]
    assert forced.text == hf_tokenizer.decode([forced_id] * 5)
    first = hf_tokenizer.convert_tokens_to_ids(plain.logprobs.tokens[0]) if plain.logprobs.tokens else None
    first_ids = hf_tokenizer.encode(plain.text, add_special_tokens=False)[:1]
    banned_id = first if isinstance(first, int) and first != hf_tokenizer.unk_token_id else first_ids[0]
    banned = client.completions.create(logit_bias={str(banned_id): -100}, logprobs=0, **args).choices[0]
    assert banned.logprobs.tokens[0] != plain.logprobs.tokens[0]


def test_echo_with_logprobs_matches_hf_prompt_logprobs(client, hf_tokenizer, tiny_model_dir):
    import torch
    import transformers

    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "echo": True, "logprobs": 2,
            "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**args).choices[0]
    prompt_ids = hf_tokenizer.encode(PROMPT)
    lp = whole.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert whole.text.startswith(PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].double(), dim=-1)
    for i in range(1, len(prompt_ids)):
        assert lp.token_logprobs[i] == pytest.approx(expected[i - 1, prompt_ids[i]].item(), abs=1e-4)
        assert 1 <= len(lp.top_logprobs[i]) <= 3
    offsets = lp.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs]
    assert "".join(c.text for c in chunks) == whole.text
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, hf_tokenizer):
    """lm-eval's loglikelihood request (vLLM accepts it): the prompt and its logprobs, nothing generated."""
    prompt_ids = hf_tokenizer.encode(PROMPT)
    args = {"model": MODEL, "prompt": PROMPT, "temperature": 0.0, "echo": True, "logprobs": 2}
    scored = client.completions.create(max_tokens=0, **args)
    generated = client.completions.create(max_tokens=3, extra_body={"ignore_eos": True}, **args).choices[0]
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.tokens == generated.logprobs.tokens[: len(prompt_ids)]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        generated.logprobs.token_logprobs[1: len(prompt_ids)], abs=1e-6)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(prompt_ids)
    chunks = [c for c in client.completions.create(max_tokens=0, stream=True, **args) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == choice.logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    plain = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=0, echo=True)
    assert [c.text for c in plain.choices] == [PROMPT, "Hello"] and all(c.logprobs is None for c in plain.choices)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens" and "echo" in refused.value.body["message"]
