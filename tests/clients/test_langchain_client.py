"""langchain-openai against `kestrel serve`: ChatOpenAI's invoke, stream, with_structured_output in its three
methods and bind_tools, and OpenAIEmbeddings. Embeddings skip langchain's context-length check, which counts
tokens with tiktoken's OpenAI vocabularies (a download, and not this model's tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

from .support import USER, WEATHER, Pick, Served, check_weather_call

PROMPT = USER[0]["content"]


def chat_model(served: Served, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(model=served.model, base_url=served.v1, api_key=served.api_key, max_tokens=max_tokens,
                      temperature=0, max_retries=0, timeout=60, stream_usage=True)


def test_invoke_and_stream_give_the_servers_reply(served: Served) -> None:
    expected = served.post("chat/completions", {"messages": USER, "max_tokens": 12, "temperature": 0})
    llm = chat_model(served, 12)
    message = llm.invoke(PROMPT)
    assert message.content == expected["choices"][0]["message"]["content"]
    assert message.response_metadata["finish_reason"] == "length"
    usage = expected["usage"]
    assert message.usage_metadata["input_tokens"] == usage["prompt_tokens"]
    assert message.usage_metadata["output_tokens"] == usage["completion_tokens"] == 12
    chunks = list(llm.stream(PROMPT))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert len(chunks) > 2 and merged.content == message.content
    assert merged.usage_metadata == message.usage_metadata


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_fills_the_pydantic_model(served: Served, method: str) -> None:
    result = chat_model(served, 100).with_structured_output(Pick, method=method, include_raw=True).invoke("Pick one")
    assert result["parsing_error"] is None and isinstance(result["parsed"], Pick)
    raw: AIMessage = result["raw"]
    if method == "function_calling":  # the schema became a tool, which the server was told to call
        (call,) = raw.tool_calls
        assert call["name"] == "Pick" and call["args"] == result["parsed"].model_dump()
    else:
        assert json.loads(raw.content) == result["parsed"].model_dump()


def test_json_mode_gives_a_json_object(served: Served) -> None:
    """json_mode asks for any JSON object (the schema only reaches the parser), so the check is that the reply is
    one and langchain parsed exactly that object. A random model may nest objects until max_tokens; on this prompt
    it closes the object within the budget."""
    anything = {"title": "Anything", "type": "object"}
    result = chat_model(served, 256).with_structured_output(anything, method="json_mode", include_raw=True).invoke(
        "JSON please")
    assert result["parsing_error"] is None and result["raw"].response_metadata["finish_reason"] == "stop"
    assert isinstance(result["parsed"], dict) and result["parsed"] == json.loads(result["raw"].content)


@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_bind_tools_returns_a_valid_call(served: Served, tool_choice: str) -> None:
    message = chat_model(served, 100).bind_tools([WEATHER], tool_choice=tool_choice).invoke(PROMPT)
    (call,) = message.tool_calls
    check_weather_call(call["name"], call["args"])
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_openai_embeddings_equal_transformers(served: Served, hf_embed: Callable[[str], np.ndarray]) -> None:
    embeddings = OpenAIEmbeddings(model=served.model, base_url=served.v1, api_key=served.api_key,
                                  check_embedding_ctx_length=False, max_retries=0, timeout=60)
    texts = ["The quick brown fox", "kestrel", "a third, longer document about birds of prey"]
    for vector, text in zip(embeddings.embed_documents(texts), texts):
        assert np.allclose(vector, hf_embed(text), atol=1e-5)
    assert np.allclose(embeddings.embed_query(texts[1]), hf_embed(texts[1]), atol=1e-5)
