"""Every request field is honoured or refused, never ignored: the vLLM and OpenAI fields kestrel does not implement
yet are a 400 that names the field and says why; any other unknown field is a 400 too; unknown fields sent as
null or empty (as clients replaying OpenAI responses do) ask for nothing and are accepted."""

import httpx
import pytest
from conftest import MODEL

from kestrel.config import ConfigError, EngineConfig
from kestrel.entrypoints.protocol import NOT_SUPPORTED_FIELDS

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
# vLLM's extra request fields (vllm/entrypoints/openai/protocol.py, CompletionRequest and ChatCompletionRequest)
# and OpenAI's newer chat fields that kestrel does not implement yet, with a value that would ask for something.
UNSUPPORTED = {
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"], "guided_grammar": "x",
    "structured_outputs": {"choice": ["a"]}, "allowed_token_ids": [1, 2], "bad_words": ["x"], "prompt_logprobs": 1,
    "truncate_prompt_tokens": 8, "return_tokens_as_token_ids": True, "use_beam_search": True, "priority": 1,
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
    "continue_final_message": True, "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
    "reasoning_effort": "low", "functions": [{"name": "f"}],
}
CHAT_ONLY = {"echo": True, "add_generation_prompt": False}


@pytest.mark.parametrize("field", sorted(CHAT_ONLY))
def test_chat_fields_kestrel_has_only_for_completions_are_refused(openai_server, field):
    response = httpx.post(f"{openai_server.base_url}/v1/chat/completions", json={**CHAT, field: CHAT_ONLY[field]},
                          headers=openai_server.headers, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def post(server, path, body):
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=30)


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
            "guided_json": None, "metadata": {}, "use_beam_search": False, "priority": 0, "echo": False,
            "add_generation_prompt": True}
    response = post(openai_server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text


def test_openai_client_extra_body_fields_are_checked(openai_server):
    import openai

    client = openai_server.client()
    with pytest.raises(openai.BadRequestError, match="guided_choice"):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2,
                                       extra_body={"guided_choice": ["yes", "no"]})


def test_tensor_parallel_size_other_than_one_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        EngineConfig.from_kwargs(tiny_model_dir, tensor_parallel_size=2)
