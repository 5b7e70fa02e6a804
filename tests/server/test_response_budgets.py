"""Response budgets: a response's size is bounded by --max-response-bytes (refused up front where n, max_tokens and
the logprobs bound it, ended while produced where only the context does), stop strings and bad words by count and
length; requests within the budgets are served as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import API_KEY, MAX_MODEL_LEN, MODEL, LiveServer
from http_client import HTTP

from kestrel.entrypoints.budgets import (
    CHAT_ENTRY_FLOOR,
    COMPLETION_ENTRY_FLOOR,
    MAX_BAD_WORD_CHARS,
    MAX_STOP_STRING_CHARS,
    ResponseBudget,
    ResponseShape,
    ResponseTooLargeError,
    estimate,
)
from kestrel.entrypoints.protocol import ChatLogProb, ChatLogProbsContent
from kestrel.entrypoints.server import build_app
from kestrel.entrypoints.server_config import ServerConfig

MESSAGES = [{"role": "user", "content": "hi"}]
SMALL_BUDGET = 4000  # bytes: about 1,200 tokens of the test model's plain text


class SharedEngineServer(LiveServer):
    """An app with settings of its own over the engine of another server: stopping it leaves the engine running."""

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@pytest.fixture(scope="module")
def small_budget(openai_server: LiveServer) -> Iterator[LiveServer]:
    app = build_app(openai_server.engine, MODEL, api_key=API_KEY, max_response_bytes=SMALL_BUDGET)
    server = SharedEngineServer(app, openai_server.engine)
    yield server
    server.stop()


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return HTTP.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, headers=server.headers, timeout=120)


def generated_tokens(server: LiveServer) -> float:
    return server.metrics()["kestrel:generation_tokens_total"]


# ----- refused before any work ----------------------------------------------------------------------

def test_the_12_mb_logprobs_request_is_refused_up_front(openai_server):
    """The issue's row: 160 bytes that asked for a 12 MB body and 46.8 CPU-seconds. With the defaults it is a
    400 that names the fields and the flag, and the engine never sees it. (The row's max_tokens=512 is past this
    server's 256-token context, itself a 400 now, as in vLLM; n=24 x 230 tokens asks for as much.)"""
    before = generated_tokens(openai_server)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_server.client().chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                                       top_logprobs=20, n=24, max_tokens=230,
                                                       extra_body={"ignore_eos": True})
    error = caught.value
    assert error.status_code == 400 and error.code == "response_too_large" and error.param == "top_logprobs"
    for named in ("n=24", "max_tokens=230", "top_logprobs=20", "--max-response-bytes",
                  f"{ServerConfig().max_response_bytes:,} bytes"):
        assert named in error.message
    assert generated_tokens(openai_server) == before


def test_completions_name_their_own_fields(small_budget):
    body = {"prompt": "def f(x):", "max_tokens": 64, "logprobs": 5, "n": 2}
    reply = post(small_budget, "/v1/completions", body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("logprobs", "response_too_large")
    assert "n=2 x max_tokens=64" in error["message"] and "logprobs=5" in error["message"]
    chat = post(small_budget, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 4000})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"


def test_the_prompts_part_counts_too(small_budget):
    """prompt_logprobs and echo repeat the prompt in the response: bounded before any token is generated."""
    prompt = "import os\n" * 20
    reply = post(small_budget, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 5})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs"
    echoed = post(small_budget, "/v1/completions", {"prompt": prompt * 2, "max_tokens": 1, "echo": True, "n": 8})
    assert echoed.status_code == 400 and echoed.json()["error"]["param"] == "echo"
    assert echoed.json()["error"]["code"] == "response_too_large"


# ----- ended while produced ---------------------------------------------------------------------------

def test_a_stream_past_the_budget_ends_with_an_error_event(small_budget):
    """No max_tokens: only the context bounds the answer, so the request is admitted and counted as it streams."""
    # Six choices run to the context: their text alone passes the budget, however the reader's events are merged.
    body = {"messages": MESSAGES, "stream": True, "ignore_eos": True, "n": 6}
    with HTTP.stream("POST", f"{small_budget.base_url}/v1/chat/completions", json={"model": MODEL, **body},
                     headers=small_budget.headers, timeout=120) as reply:
        assert reply.status_code == 200
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "response_too_large" and "--max-response-bytes" in error["message"]
    chunks = [json.loads(event) for event in events[:-2]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert 0 < len(content.encode()) <= SMALL_BUDGET
    assert not any(c["choices"][0].get("finish_reason") for c in chunks)  # it was cut, not finished
    assert small_budget.wait_idle()["kestrel:num_requests_running"] == 0  # the engine request was aborted

    stream = small_budget.client().chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, n=6,
                                                            extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError, match="--max-response-bytes"):
        for _ in stream:
            pass


def test_a_whole_response_past_the_budget_is_a_400_and_stops_the_work(small_budget):
    n = 8
    before = generated_tokens(small_budget)
    with pytest.raises(openai.BadRequestError) as caught:
        small_budget.client().chat.completions.create(model=MODEL, messages=MESSAGES, n=n,
                                                      extra_body={"ignore_eos": True})
    assert caught.value.code == "response_too_large" and "--max-response-bytes" in caught.value.message
    small_budget.wait_idle()
    # Ended once its text passed the budget, before the n answers filled the context.
    assert generated_tokens(small_budget) - before < 0.8 * n * (MAX_MODEL_LEN - 20)


def test_a_whole_body_is_measured_in_full():
    budget = ResponseBudget(100, ResponseShape(chat=True, n=1, logprobs=None, prompt_logprobs=None))
    budget.body(b"x" * 100)
    with pytest.raises(ResponseTooLargeError, match="100 bytes"):
        budget.body(b"x" * 101)


# ----- what the estimates rest on ---------------------------------------------------------------------

SHAPES = [  # (path, request fields, shape): 2 choices of 32 tokens each
    ("/v1/chat/completions", {}, dict(chat=True, logprobs=None)),
    ("/v1/chat/completions", {"logprobs": True}, dict(chat=True, logprobs=0)),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 5}, dict(chat=True, logprobs=5)),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 20}, dict(chat=True, logprobs=20)),
    ("/v1/chat/completions", {"prompt_logprobs": 5, "return_token_ids": True},
     dict(chat=True, logprobs=None, prompt_logprobs=5, token_ids=True)),
    ("/v1/completions", {}, dict(chat=False, logprobs=None)),
    ("/v1/completions", {"logprobs": 0}, dict(chat=False, logprobs=0)),
    ("/v1/completions", {"logprobs": 5}, dict(chat=False, logprobs=5)),
    ("/v1/completions", {"logprobs": 20}, dict(chat=False, logprobs=20)),
    # echo with logprobs: each choice also carries the prompt's logprobs (vLLM's choices[].prompt_logprobs)
    ("/v1/completions", {"logprobs": 5, "echo": True}, dict(chat=False, logprobs=5, echo_logprobs=True,
                                                            prompt_logprobs=5)),
]


@pytest.mark.parametrize("path, fields, shape", SHAPES,
                         ids=[f"{p.split('/')[-1]}-{'-'.join(f) or 'plain'}-{s['logprobs']}" for p, f, s in SHAPES])
def test_the_estimate_bounds_real_responses(openai_server, path, fields, shape):
    """The per-token byte estimates hold for real bodies (measured here, as they were chosen), and are not so
    loose that they refuse twice the size they should."""
    n, max_tokens = 2, 32
    prompt = {"messages": MESSAGES} if shape["chat"] else {"prompt": "def f(x):\n    return"}
    reply = post(openai_server, path, {**prompt, **fields, "n": n, "max_tokens": max_tokens, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    echo_bytes = [len(b"def f(x):\n    return")] if fields.get("echo") else []
    found = estimate(ResponseShape(**{"n": n, "prompt_logprobs": None, "echo_bytes": echo_bytes, **shape}),
                     [prompt_tokens], max_tokens, MAX_MODEL_LEN)
    assert len(reply.content) <= found.total
    if shape["logprobs"] is not None:
        assert len(reply.content) >= found.total / 2


def test_the_floors_are_the_least_an_entry_can_take():
    """A whole response is ended early only when its body would surely pass the budget."""
    empty_top = ChatLogProb(token="", logprob=0.0, bytes=[])
    empty = ChatLogProbsContent(token="", logprob=0.0, bytes=[], top_logprobs=[])
    assert CHAT_ENTRY_FLOOR.token <= len(empty.model_dump_json())
    assert CHAT_ENTRY_FLOOR.top <= len(empty_top.model_dump_json())
    completion_entry = json.dumps({"tokens": [""], "token_logprobs": [0.0], "text_offset": [0], "top_logprobs": [{}]},
                                  separators=(",", ":"))
    bare = json.dumps({"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []},
                      separators=(",", ":"))
    assert COMPLETION_ENTRY_FLOOR.token <= len(completion_entry) - len(bare)
    assert COMPLETION_ENTRY_FLOOR.top <= len('"":0.0')


# ----- stop strings and bad words -----------------------------------------------------------------------

LIST_LIMITS = [
    ({"stop": [f"s{i}" for i in range(65)]}, "stop", "--max-stop-sequences"),
    ({"stop_token_ids": list(range(10, 75))}, "stop_token_ids", "--max-stop-sequences"),
    ({"bad_words": [f"w{i}" for i in range(129)]}, "bad_words", "--max-bad-words"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", f"{MAX_STOP_STRING_CHARS:,} characters"),
    ({"stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop[1]", f"{MAX_STOP_STRING_CHARS:,} characters"),
    ({"bad_words": ["y" * (MAX_BAD_WORD_CHARS + 1)]}, "bad_words[0]", f"{MAX_BAD_WORD_CHARS:,} characters"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields, param, named", LIST_LIMITS, ids=[p for _, p, _ in LIST_LIMITS])
def test_stop_strings_and_bad_words_are_bounded(openai_server, path, fields, param, named):
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"}
    reply = post(openai_server, path, {**prompt, **fields, "max_tokens": 1})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and named in error["message"]


def test_requests_at_the_limits_are_served(openai_server):
    config = ServerConfig()
    body = {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(config.max_stop_sequences)],
            "stop_token_ids": list(range(10, 10 + config.max_stop_sequences)),
            "bad_words": [f"w{i}" for i in range(config.max_bad_words)]}
    assert post(openai_server, "/v1/completions", body).status_code == 200
    long_stop = {"messages": MESSAGES, "max_tokens": 2, "stop": "x" * MAX_STOP_STRING_CHARS}
    assert post(openai_server, "/v1/chat/completions", long_stop).status_code == 200


# ----- normal requests ----------------------------------------------------------------------------------

def test_normal_requests_are_unaffected(openai_server, small_budget):
    client = openai_server.client()
    # No max_tokens and no logprobs: only the context bounds it, and it runs to the end of the context.
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "length"
    with_logprobs = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=5,
                                                   n=2, max_tokens=16, extra_body={"ignore_eos": True})
    assert all(len(c.logprobs.content) == 16 for c in with_logprobs.choices)
    echoed = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, echo=True, logprobs=1)
    assert echoed.choices[0].text.startswith("def f(x):")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=5,
                                            max_tokens=16, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 16
    # A small budget still serves small answers, whole and streamed.
    small = small_budget.client()
    assert small.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices[0].finish_reason
    streamed = small.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True)
    assert any(c.choices and c.choices[0].finish_reason for c in streamed)
