"""Schemathesis fuzzes every operation of the server's OpenAPI schema (valid and invalid inputs): never a 5xx,
and every response conforms to the document (its status code, content type, headers and body schema).

The server runs the real tiny model with a short context, so even the largest valid requests
(n = 128, no max_tokens) finish quickly; the engine must survive every sampling setting the
schema allows. Its budgets are small (a 12 KiB response, 4 stop strings, 4 bad words), so that fuzzed
requests also cross them: refused up front or ended mid-stream, each with a well-formed error.
"""

import json
from collections.abc import Iterator

import pytest
import schemathesis
from http_client import HTTP
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app

MAX_EXAMPLES = 120  # per operation and mode (valid / invalid inputs); GETs without parameters run fewer
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
BUDGET_BYTES = 12 << 10  # the fuzzed server's --max-response-bytes
TOKENIZE_BYTES = 4096


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: str, live_server_class) -> Iterator:
    engine = AsyncEngine.from_args(tiny_model_dir, max_model_len=48, max_num_seqs=128, max_num_batched_tokens=512,
                                   device="cpu", dtype="float32", max_queued_requests=4096).start()
    app = build_app(engine, "tiny", api_key="fuzz-key", max_request_bytes=1 << 20, max_response_bytes=BUDGET_BYTES,
                    max_stop_sequences=4, max_bad_words=4, max_tokenize_bytes=TOKENIZE_BYTES)
    server = live_server_class(app, engine, api_key="fuzz-key")
    yield server
    server.stop()


# The pooling endpoints (served on a generation model too: last-token embeddings, cosine scores) share one
# implementation per request shape, so their aliases get fewer examples.
POOLING_OPERATIONS = [("POST", "/pooling"), ("POST", "/score"), ("POST", "/v1/score"), ("POST", "/rerank"),
                      ("POST", "/v1/rerank"), ("POST", "/v2/rerank"), ("POST", "/classify")]
POOLING_EXAMPLES = 40
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
              ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
              ("POST", "/v1/responses/{response_id}/cancel"),
              ("POST", "/v1/embeddings"), *POOLING_OPERATIONS, ("POST", "/tokenize"),
              ("POST", "/v1/audio/transcriptions"), ("POST", "/v1/audio/translations"),
              ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("GET", "/health"),
              ("GET", "/version"), ("GET", "/metrics")]


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json", headers=fuzz_server.headers)


def test_every_operation_is_fuzzed(fuzz_schema):
    found = {(op.ok().method.upper(), op.ok().path) for op in fuzz_schema.get_all_operations()}
    assert found == set(OPERATIONS)


# Invalid inputs need something to break: a JSON body (any string is a valid model id).
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST" and not p.endswith("/cancel")]


CALLS: dict[tuple[str, str, str], int] = {}


@pytest.mark.parametrize("method, path, mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_no_server_errors(fuzz_server, fuzz_schema, method, path, mode):
    operation = fuzz_schema[path][method]

    examples = POOLING_EXAMPLES if (method, path) in POOLING_OPERATIONS else MAX_EXAMPLES

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call(headers=fuzz_server.headers, timeout=120)
        CALLS[method, path, mode.value] = CALLS.get((method, path, mode.value), 0) + 1
        assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400 and path != "/health":
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert fuzz_server.engine.is_healthy

    check()


def test_the_fuzzing_ran_at_least_1000_cases():
    if len(CALLS) < len(CASES):
        pytest.skip("runs after the whole fuzzing set")
    assert sum(CALLS.values()) >= 1000, CALLS


@given(chat=st.booleans(), stream=st.booleans(), n=st.sampled_from([1, 3, 16, 40, 128]),
       max_tokens=st.none() | st.integers(1, 64), logprobs=st.none() | st.integers(0, 20), echo=st.booleans())
@example(chat=True, stream=True, n=40, max_tokens=None, logprobs=None, echo=False)  # ends mid-stream
@settings(max_examples=24, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_responses_stay_within_their_budget(fuzz_server, chat, stream, n, max_tokens, logprobs, echo):
    """Budget cases: whatever multiplies a response, it is served within --max-response-bytes, refused up front
    (400 response_too_large or the logprob-entries limit; or, as vLLM, a 400 naming max_tokens where the prompt
    and max_tokens pass the 48-token context), or ended mid-stream with an error event then [DONE]."""
    body: dict = {"model": "tiny", "n": n, "stream": stream, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "assistant" if echo else "user", "content": "def f(x):\n    return"}]
        body.update(echo=echo, max_completion_tokens=max_tokens)
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
    else:
        body.update(prompt="def f(x):\n    return", echo=echo, max_tokens=max_tokens, logprobs=logprobs)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with HTTP.stream("POST", f"{fuzz_server.base_url}{path}", json=body, headers=fuzz_server.headers,
                     timeout=120) as response:
        content = response.read()
    assert response.status_code in (200, 400), content[:500]
    if response.status_code == 400:
        error = json.loads(content)["error"]
        past_context = error["param"] in ("max_tokens", "max_completion_tokens") and "max_model_len" in error["message"]
        assert error["code"] == "response_too_large" or "--max-logprob-entries" in error["message"] or (
            past_context and max_tokens is not None), error
    elif not stream:
        assert len(content) <= BUDGET_BYTES
    else:
        events = [line[len("data: "):] for line in content.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2]) if len(events) > 1 else {}
        if "error" in last:
            assert last["error"]["code"] == "response_too_large", last


def _deep_schema_text(levels: int) -> str:
    return '{"items":' * levels + "{}" + "}" * levels


_TOOL_MESSAGES = [{"role": "user", "content": "call it"}]
# Hostile grammars, each refused before any compiling (or by the compiler itself) with a 400 naming its field.
GRAMMAR_CASES = [
    ("/v1/completions", {"structured_outputs": {"json": _deep_schema_text(50_000)}}, "structured_outputs.json"),
    ("/v1/completions", {"guided_json": {"$defs": {"e": {"enum": list(range(5000))}}, "$ref": "#/$defs/e"}},
     "guided_json"),
    ("/v1/completions", {"structured_outputs": {"json": {"anyOf": [{"const": i} for i in range(5000)]}}},
     "structured_outputs.json"),
    ("/v1/completions", {"guided_choice": [f"c{i}" for i in range(5000)]}, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"regex": "a" * 70_000}}, "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"regex": "\ud800+"}}, "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= ( | "}}, "structured_outputs.grammar"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "string", "pattern": "(["}}},
     "structured_outputs.json"),
    ("/v1/chat/completions", {"messages": _TOOL_MESSAGES, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"enum": list(range(5000))}}}]}, "tools"),
    ("/v1/chat/completions", {"messages": _TOOL_MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": {
            "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}}}},
     "response_format"),
]


@pytest.mark.parametrize("path, fields, param", GRAMMAR_CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(GRAMMAR_CASES)])
def test_hostile_grammars_are_400s(fuzz_server, path, fields, param):
    body = {"model": "tiny", "max_tokens": 4, **({"prompt": "x"} if path == "/v1/completions" else {}), **fields}
    reply = HTTP.post(f"{fuzz_server.base_url}{path}", content=json.dumps(body).encode(), timeout=30,
                      headers={**fuzz_server.headers, "Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == param, reply.json()
    assert fuzz_server.engine.is_healthy


@given(text=st.text(min_size=0, max_size=1600), copies=st.integers(1, 8), chat=st.booleans(),
       stream=st.booleans())
@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_tokenizer_inputs_are_counted_or_refused(fuzz_server, text, copies, chat, stream):
    """Tokenizer cases: any text, around --max-tokenize-bytes (4 KiB here, UTF-8), is tokenized or refused with a
    400 naming the limit on /tokenize; as a prompt it is served or refused as too long, never a 5xx."""
    prompt = text * copies
    body = ({"model": "tiny", "messages": [{"role": "user", "content": prompt}]} if chat
            else {"model": "tiny", "prompt": prompt})
    reply = HTTP.post(f"{fuzz_server.base_url}/tokenize", json=body, headers=fuzz_server.headers, timeout=60)
    size = len(prompt.encode("utf-8", "surrogatepass"))
    if reply.status_code == 400:
        error = reply.json()["error"]
        assert "--max-tokenize-bytes" in error["message"] or "surrogate" in error["message"], error
        assert size > TOKENIZE_BYTES or "surrogate" in error["message"], (size, error)
    else:
        assert reply.status_code == 200, reply.text[:300]
        assert size <= TOKENIZE_BYTES and reply.json()["count"] == len(reply.json()["tokens"])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    served = HTTP.post(f"{fuzz_server.base_url}{path}", json={**body, "max_tokens": 1, "stream": stream},
                       headers=fuzz_server.headers, timeout=60)
    assert served.status_code in (200, 400), served.text[:300]
