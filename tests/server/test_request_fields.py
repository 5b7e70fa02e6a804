"""Every request field is honoured or refused, never ignored: the vLLM and OpenAI fields kestrel does not implement
yet are a 400 that names the field and says why; any other unknown field is a 400 too; unknown fields sent as
null or empty (as clients replaying OpenAI responses do) ask for nothing and are accepted."""

import pytest
from conftest import MODEL
from http_client import HTTP

from kestrel.config import ConfigError, EngineConfig
from kestrel.entrypoints.protocol import NOT_SUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
# vLLM's extra request fields (vllm/entrypoints/openai/protocol.py, CompletionRequest and ChatCompletionRequest)
# and OpenAI's newer chat fields that kestrel does not implement yet, with a value that would ask for something.
UNSUPPORTED = {
    "guided_whitespace_pattern": " ", "structural_tag": "{}", "store": True,
    "metadata": {"k": "v"}, "service_tier": "flex",
    "functions": [{"name": "f"}],
}
CHAT_ONLY = {"add_special_tokens": True}


@pytest.mark.parametrize("field", sorted(CHAT_ONLY))
def test_chat_fields_kestrel_has_only_for_completions_are_refused(openai_server, field):
    response = HTTP.post(f"{openai_server.base_url}/v1/chat/completions", json={**CHAT, field: CHAT_ONLY[field]},
                         headers=openai_server.headers, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


# Every field of vLLM's request models (vllm/entrypoints/openai/protocol.py: CompletionRequest and
# ChatCompletionRequest, vLLM 0.10-0.11) with a value that asks for something. Each is either a field kestrel's
# request model has (honoured; the other tests check the effects) or refused with a 400 that names it.
VLLM_COMMON = {
    "model": MODEL, "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}, "max_tokens": 3, "n": 2,
    "presence_penalty": 0.5, "seed": 7, "stop": ["zz"], "stream": False, "temperature": 0.5, "top_p": 0.9,
    "user": "u1", "use_beam_search": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
    "length_penalty": 0.5, "stop_token_ids": [9], "include_stop_str_in_output": True, "ignore_eos": True,
    "min_tokens": 1, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4, "prompt_logprobs": 1, "allowed_token_ids": [5, 6], "bad_words": ["x"],
    "add_special_tokens": True, "response_format": {"type": "json_object"}, "guided_json": {"type": "object"},
    "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= 'a'", "structural_tag": "{}",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "structured_outputs": {"choice": ["a"]},
    "priority": 1, "request_id": "mine", "logits_processors": ["x"], "return_tokens_as_token_ids": True,
    "return_token_ids": True, "cache_salt": "s", "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
}
VLLM_COMPLETION = {**VLLM_COMMON, "prompt": "hi", "best_of": 3, "echo": True, "logprobs": 2, "suffix": "end",
                   "stream_options": {"include_usage": True}, "prompt_embeds": "AAAA"}
VLLM_CHAT = {**VLLM_COMMON, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
             "max_completion_tokens": 3, "tools": None, "tool_choice": "none", "parallel_tool_calls": False,
             "reasoning_effort": "low", "include_reasoning": False, "best_of": 3, "echo": True,
             "add_generation_prompt": False, "continue_final_message": True, "documents": [{"t": "x"}],
             "chat_template": "{{ messages }}", "chat_template_kwargs": {"a": 1}, "mm_processor_kwargs": {"a": 1},
             "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("path, fields, model", [("/v1/completions", VLLM_COMPLETION, CompletionRequest),
                                                 ("/v1/chat/completions", VLLM_CHAT, ChatCompletionRequest)])
def test_every_vllm_request_field_is_honoured_or_refused(openai_server, path, fields, model):
    required = {"prompt", "messages", "model"}
    base = {k: fields[k] for k in required if k in fields}
    for name, value in fields.items():
        if name in required:
            continue
        if name in model.model_fields:  # a field of kestrel's request model: honoured
            continue
        response = post(openai_server, path, {**base, name: value})
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name, (name, response.json())


def post(server, path, body):
    return HTTP.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=30)


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_unsupported_fields_are_refused_with_the_reason(openai_server, path, base, field):
    response = post(openai_server, path, {**base, field: UNSUPPORTED[field]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and NOT_SUPPORTED_FIELDS[field] in error["message"]


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                        ("/tokenize", {"model": MODEL, "prompt": "hi"})])
def test_any_other_unknown_field_is_refused(openai_server, path, base):
    response = post(openai_server, path, {**base, "temprature": 0.5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "temprature" and "unknown field" in error["message"]


def test_unknown_fields_inside_messages_are_refused_too(openai_server):
    body = {**CHAT, "messages": [{"role": "user", "content": "hi", "weight": 2}]}
    error = post(openai_server, "/v1/chat/completions", body).json()["error"]
    assert error["param"] == "messages[0].weight"


def test_null_and_empty_unknown_fields_ask_for_nothing(openai_server):
    replayed = {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None,
                "function_call": None}
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}, replayed, {"role": "user", "content": "more"}],
            "guided_json": None, "metadata": {}, "use_beam_search": False, "priority": 0,
            "add_generation_prompt": True, "store": False, "include_reasoning": True,
            "service_tier": "auto", "modalities": ["text"]}
    response = post(openai_server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    for name, value in (("service_tier", "flex"), ("modalities", ["text", "audio"])):  # these ask for something
        refused = post(openai_server, "/v1/chat/completions", {**CHAT, name: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name


def test_openai_client_extra_body_fields_are_checked(openai_server):
    import openai

    client = openai_server.client()
    with pytest.raises(openai.BadRequestError, match="structural_tag"):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2,
                                       extra_body={"structural_tag": "{}"})
    answer = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=4,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert answer.choices[0].message.content in ("yes", "no")


def test_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3.*num_attention_heads"):
        EngineConfig.from_kwargs(tiny_model_dir, tensor_parallel_size=3)


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True])
def test_distributed_timeout_must_be_finite_seconds(tiny_model_dir, value):
    with pytest.raises(ConfigError, match="distributed_timeout_s"):
        EngineConfig.from_kwargs(tiny_model_dir, distributed_timeout_s=value)


def test_add_special_tokens_is_honoured_on_completions(openai_server, tiny_model_dir):
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert hf_tokenizer.encode("hello there") != hf_tokenizer.encode("hello there", add_special_tokens=False)
    counts = {}
    for flag in (True, False):
        reply = post(openai_server, "/v1/completions", {**COMPLETION, "prompt": "hello there",
                                                         "add_special_tokens": flag}).json()
        counts[flag] = reply["usage"]["prompt_tokens"]
    assert counts[True] == len(hf_tokenizer.encode("hello there", add_special_tokens=True))
    assert counts[False] == len(hf_tokenizer.encode("hello there", add_special_tokens=False))



def test_truncate_prompt_tokens_keeps_the_last_tokens(openai_server):
    ids = list(range(5, 400))  # longer than the context (256) until truncated
    reply = post(openai_server, "/v1/completions", {**COMPLETION, "prompt": ids, "truncate_prompt_tokens": 7})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 7
    assert post(openai_server, "/v1/completions", {**COMPLETION, "prompt": ids}).status_code == 400
    chat = post(openai_server, "/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3
    # vLLM's -1 is max_model_len (a pooled input may fill it); more than max_model_len is refused by name
    embedded = post(openai_server, "/v1/embeddings", {"model": MODEL, "input": ids, "truncate_prompt_tokens": -1})
    assert embedded.status_code == 200 and embedded.json()["usage"]["prompt_tokens"] == 256
    for path, body in (("/v1/embeddings", {"model": MODEL, "input": [5, 6]}), ("/v1/completions", COMPLETION)):
        refused = post(openai_server, path, {**body, "truncate_prompt_tokens": 257})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
        assert "more than max_model_len=256" in refused.json()["error"]["message"]


@pytest.mark.parametrize("key", ["add_generation_prompt", "tools", "messages"])
def test_template_kwargs_may_not_set_what_the_request_sets(openai_server, key):
    refused = post(openai_server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {key: True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    assert key in refused.json()["error"]["message"] and "send them there" in refused.json()["error"]["message"]


def test_request_chat_templates_need_the_servers_trust(openai_server, start_scripted_server, tiny_model_dir):
    template = "{% for m in messages %}[{{ m['content'] }}|{{ greeting }}]{% endfor %}"
    body = {**CHAT, "chat_template": template, "chat_template_kwargs": {"greeting": "hello there"}}
    refused = post(openai_server, "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    trusting, _ = start_scripted_server(trust_request_chat_template=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = HTTP.post(f"{trusting.base_url}/v1/chat/completions", json=body, headers=trusting.headers,
                       timeout=30).json()["usage"]["prompt_tokens"]
    assert tokens == len(tokenizer.encode("[hi|hello there]", add_special_tokens=False))


def test_continue_final_message_leaves_the_assistant_turn_open(openai_server, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {**CHAT, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    reply = post(openai_server, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True,
                                         add_generation_prompt=False)
    assert text.endswith("Once upon")
    assert reply.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    both = post(openai_server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"



def test_allowed_token_ids_restrict_what_is_generated(openai_server, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply = post(openai_server, "/v1/completions", {**COMPLETION, "max_tokens": 6, "ignore_eos": True,
                                                     "temperature": 1.0, "seed": 3, "allowed_token_ids": [11]}).json()
    assert reply["choices"][0]["text"] == tokenizer.decode([11] * 6)
    for name in ("allowed_token_ids", "stop_token_ids"):  # an id the model can never produce is refused
        out_of_vocab = post(openai_server, "/v1/completions", {**COMPLETION, name: [10 ** 9]})
        assert out_of_vocab.status_code == 400 and out_of_vocab.json()["error"]["param"] == name



@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_leads_with_the_assistants_own_last_message(openai_server, stream):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {**CHAT, "messages": messages, "continue_final_message": True, "add_generation_prompt": False,
            "echo": True, "max_tokens": 3, "stream": stream}
    if not stream:
        content = post(openai_server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    else:
        with HTTP.stream("POST", f"{openai_server.base_url}/v1/chat/completions", json=body,
                         headers=openai_server.headers, timeout=30) as reply:
            lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        import json

        content = "".join(json.loads(x)["choices"][0]["delta"].get("content") or "" for x in lines
                          if json.loads(x)["choices"])
    assert content.startswith("Once upon") and len(content) > len("Once upon")
    greedy = {**CHAT, "temperature": 0.0}  # a user's last message is not echoed: echo changes nothing
    with_echo = post(openai_server, "/v1/chat/completions", {**greedy, "echo": True}).json()
    assert with_echo["choices"][0]["message"] == post(openai_server, "/v1/chat/completions",
                                                      greedy).json()["choices"][0]["message"]


def test_bad_words_reach_the_engine(openai_server):
    reply = post(openai_server, "/v1/completions", {**COMPLETION, "bad_words": ["hello", "world"], "max_tokens": 4})
    assert reply.status_code == 200
    bad = post(openai_server, "/v1/completions", {**COMPLETION, "bad_words": [""]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("bad_words")


def test_prompt_logprobs_come_back_keyed_by_the_prompts_own_tokens(openai_server):
    body = {**COMPLETION, "prompt": "def add(a, b):", "prompt_logprobs": 2, "return_token_ids": True}
    choice = post(openai_server, "/v1/completions", body).json()["choices"][0]
    prompt_ids, entries = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) > 2 and entries[0] is None  # the first token has no context
    for token_id, entry in zip(prompt_ids[1:], entries[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        ranks = sorted(e["rank"] for key, e in entry.items() if key != str(token_id) or e["rank"] <= 2)
        assert ranks[:2] == [1, 2] and len(entry) <= 3
    chat = post(openai_server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0, "return_token_ids": True}).json()
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    streamed = post(openai_server, "/v1/completions", {**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_token_ids_and_tokens_as_token_ids(openai_server):
    # /detokenize keeps special tokens, so the completion's text must too: a sampled special token (the shared
    # server's earlier requests decide what is sampled) is in its token ids either way
    body = {**COMPLETION, "max_tokens": 5, "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True,
            "return_token_ids": True, "skip_special_tokens": False}
    choice = post(openai_server, "/v1/completions", body).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(all(key.startswith("token_id:") for key in top) for top in choice["logprobs"]["top_logprobs"])
    text = HTTP.post(f"{openai_server.base_url}/detokenize", json={"model": MODEL, "tokens": choice["token_ids"]},
                     headers=openai_server.headers, timeout=30).json()["prompt"]
    assert text == choice["text"]
    chat = post(openai_server, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "ignore_eos": True, "logprobs": True,
                                                         "return_tokens_as_token_ids": True,
                                                         "return_token_ids": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert chat["prompt_token_ids"][0] == 0  # BOS


def test_return_token_ids_when_streaming(openai_server):
    import json

    body = {**CHAT, "max_tokens": 5, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with HTTP.stream("POST", f"{openai_server.base_url}/v1/chat/completions", json=body,
                     headers=openai_server.headers, timeout=30) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[0]["prompt_token_ids"][0] == 0
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    whole = post(openai_server, "/v1/chat/completions", {**body, "stream": False, "temperature": 0.0})
    again = post(openai_server, "/v1/chat/completions", {**body, "stream": False, "temperature": 0.0})
    assert len(streamed) == 5 and whole.json()["choices"][0]["token_ids"] == again.json()["choices"][0]["token_ids"]


def test_logprobs_beyond_max_logprobs_are_refused_by_name(openai_server):
    chat = post(openai_server, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"
    assert "max_logprobs=20" in chat.json()["error"]["message"]
    completion = post(openai_server, "/v1/completions", {**COMPLETION, "prompt_logprobs": 25})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "prompt_logprobs"


def test_priority_needs_the_priority_policy(openai_server):
    refused = post(openai_server, "/v1/completions", {**COMPLETION, "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]
    assert post(openai_server, "/v1/chat/completions", {**CHAT, "priority": 0}).status_code == 200


def test_use_beam_search_returns_the_n_best_beams(openai_server, tiny_model_dir):
    from kestrel import LLM, BeamSearchParams

    body = {**COMPLETION, "prompt": "def f(x):", "use_beam_search": True, "n": 3, "max_tokens": 4,
            "length_penalty": 0.8}
    reply = post(openai_server, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    texts = [c["text"] for c in reply.json()["choices"]]
    llm = LLM(tiny_model_dir, max_model_len=128)
    offline = llm.beam_search(["def f(x):"], BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.8))[0]
    assert texts == [seq.text for seq in offline.sequences]
    assert reply.json()["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in offline.sequences)
    chat = post(openai_server, "/v1/chat/completions", {**CHAT, "use_beam_search": True, "n": 2, "max_tokens": 3})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2
    for field, value in (("top_p", 0.5), ("stop", ["x"]), ("logprobs", 1), ("stream", True)):
        refused = post(openai_server, "/v1/completions", {**body, field: value})
        assert refused.status_code == 400, (field, refused.text)
        assert refused.json()["error"]["param"] in (field, "use_beam_search"), refused.json()
    assert post(openai_server, "/v1/completions", {**body, "top_p": 1.0}).status_code == 200  # a no-op value
    lone = post(openai_server, "/v1/completions", {**COMPLETION, "length_penalty": 0.5})
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "length_penalty"
    assert post(openai_server, "/v1/completions", {**COMPLETION, "length_penalty": 1.0}).status_code == 200


def test_streamed_completion_token_ids_add_up_to_the_whole(openai_server):
    import json

    body = {**COMPLETION, "max_tokens": 12, "ignore_eos": True, "temperature": 0.0, "return_token_ids": True}
    whole = post(openai_server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    with HTTP.stream("POST", f"{openai_server.base_url}/v1/completions", json={**body, "stream": True},
                     headers=openai_server.headers, timeout=30) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    # Tokens whose text is held back (a split character) still send their ids.
    assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []] == whole


def test_a_request_id_names_the_response_even_while_another_request_runs_under_it(start_scripted_server):
    """vLLM's request_id: the response's id after its prefix. Requests sent under one id at once (a proxy stamping
    its X-Request-Id, a client's retry) all run: the engine's own ids are made unique, as vLLM's are."""
    server, runner = start_scripted_server(step_delay_s=0.05, script=" ".join(f"w{i}" for i in range(40)))
    completion = post(server, "/v1/completions", {**COMPLETION, "request_id": "trace-1"})
    assert completion.status_code == 200 and completion.json()["id"] == "cmpl-trace-1"
    chat = post(server, "/v1/chat/completions", {**CHAT, "request_id": "trace-1"})
    assert chat.status_code == 200 and chat.json()["id"] == "chatcmpl-trace-1"
    body = {**COMPLETION, "max_tokens": 40, "request_id": "busy", "stream": True}
    with HTTP.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers,
                     timeout=30) as running:
        lines = running.iter_lines()  # kept: a dropped line iterator closes the stream, which aborts the request
        next(lines)  # it runs
        again = post(server, "/v1/completions", {**COMPLETION, "request_id": "busy"})
        assert again.status_code == 200 and again.json()["id"] == "cmpl-busy"
        header = HTTP.post(f"{server.base_url}/v1/completions", json=COMPLETION, timeout=30,
                           headers={**server.headers, "X-Request-Id": "busy"})
        assert header.status_code == 200 and header.json()["id"] == "cmpl-busy"
        rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and all('"cmpl-busy"' in line for line in rest[:-1])  # it went on
    for bad in ("", "has space", "x" * 257):
        reply = post(server, "/v1/completions", {**COMPLETION, "request_id": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "request_id", bad


def test_the_x_request_id_header_names_the_response_before_the_body_field(start_scripted_server):
    """vLLM names a response by its X-Request-Id header first, then by the body's request_id."""
    server, _ = start_scripted_server()
    for path, body, prefix in (("/v1/completions", COMPLETION, "cmpl-"), ("/v1/chat/completions", CHAT, "chatcmpl-")):
        for extra in ({}, {"request_id": "from-body"}):
            reply = HTTP.post(f"{server.base_url}{path}", json={**body, **extra}, timeout=30,
                              headers={**server.headers, "X-Request-Id": "trace-7"})
            assert reply.status_code == 200 and reply.json()["id"] == f"{prefix}trace-7", reply.text
        bad = HTTP.post(f"{server.base_url}{path}", json=body, timeout=30,
                        headers={**server.headers, "X-Request-Id": "has space"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_a_null_max_tokens_on_completions_runs_to_the_context(start_scripted_server):
    """vLLM reads completions' "max_tokens": null as the rest of the context (left out, it is 16), so a prompt
    that leaves less than 16 tokens of room is served, not refused."""
    server, _ = start_scripted_server(script=" ".join(f"w{i}" for i in range(200)))
    limit = server.engine.max_model_len
    prompt = list(range(5, 5 + limit - 4))
    reply = post(server, "/v1/completions", {**COMPLETION, "prompt": prompt, "max_tokens": None, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4 and reply.json()["choices"][0]["finish_reason"] == "length"
    left_out = {key: value for key, value in COMPLETION.items() if key != "max_tokens"}
    refused = post(server, "/v1/completions", {**left_out, "prompt": prompt, "ignore_eos": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"  # the default 16


def test_reasoning_effort_reaches_the_chat_template(start_scripted_server):
    server, _ = start_scripted_server(trust_request_chat_template=True)
    template = "{% for m in messages %}{{ m.content }}{% endfor %} effort={{ reasoning_effort }}"
    body = {**CHAT, "chat_template": template, "return_token_ids": True}
    tokenizer = server.engine.tokenizer
    for effort in ("low", "high"):
        reply = post(server, "/v1/chat/completions", {**body, "reasoning_effort": effort})
        assert tokenizer.decode(reply.json()["prompt_token_ids"]).endswith(f"effort={effort}")
    clash = post(server, "/v1/chat/completions", {**body, "reasoning_effort": "low",
                                                  "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "reasoning_effort"
    assert post(server, "/v1/chat/completions", {**body, "reasoning_effort": "max"}).status_code == 400
