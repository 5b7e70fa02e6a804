"""The response store (`--enable-response-store`) through the official `openai` client: a continuation by
previous_response_id answers as the explicit multi-turn request does (same prompt tokens, same greedy text), also
after a stream and across a tool call; stored responses are retrieved and deleted; the least recently used is
dropped at the bound; with the store off (the default), asking for it is refused by name and nothing else changes."""

from collections.abc import Iterator

import openai
import pytest
from conftest import API_KEY, MODEL, LiveServer
from http_client import HTTP

from kestrel.config import ConfigError
from kestrel.entrypoints.cli import _server_config, build_parser
from kestrel.entrypoints.response_store import ResponseStore, StoredResponse
from kestrel.entrypoints.server import build_app
from kestrel.entrypoints.server_config import ServerConfig

GREEDY = {"max_output_tokens": 6, "temperature": 0.0}
MAX_ENTRIES = 4
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


class SharedEngineServer(LiveServer):
    """An app with settings of its own over the engine of another server: stopping it leaves the engine running."""

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def storing(server: LiveServer) -> SharedEngineServer:
    app = build_app(server.engine, MODEL, api_key=API_KEY, enable_response_store=True,
                    response_store_max_entries=MAX_ENTRIES)
    return SharedEngineServer(app, server.engine)


@pytest.fixture(scope="module")
def stored(openai_server: LiveServer) -> Iterator[openai.OpenAI]:
    server = storing(openai_server)
    yield server.client()
    server.stop()


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def assert_same_answer(continued, explicit) -> None:
    assert continued.usage.input_tokens == explicit.usage.input_tokens
    assert continued.output_text == explicit.output_text


def test_a_continuation_answers_as_the_explicit_conversation(stored):
    first = stored.responses.create(model=MODEL, input="Hello there", instructions="Be brief.", **GREEDY)
    assert first.store is True and first.previous_response_id is None
    second = stored.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id
    # The earlier instructions are not carried over: the explicit request has no system message.
    explicit = stored.responses.create(model=MODEL, store=False, **GREEDY, input=[
        user("Hello there"), assistant(first.output_text), user("And then?")])
    assert_same_answer(second, explicit)
    assert second.usage.input_tokens > first.usage.input_tokens
    # A chain: the third turn sees both earlier ones, and its own instructions.
    third = stored.responses.create(model=MODEL, input="Why?", instructions="Be kind.",
                                    previous_response_id=second.id, **GREEDY)
    explicit = stored.responses.create(model=MODEL, store=False, instructions="Be kind.", **GREEDY, input=[
        user("Hello there"), assistant(first.output_text), user("And then?"), assistant(second.output_text),
        user("Why?")])
    assert_same_answer(third, explicit)


def test_a_streamed_response_is_stored_once_completed(stored):
    with stored.responses.stream(model=MODEL, input="Tell me a story", **GREEDY) as stream:
        completed = list(stream)[-1]
        final = stream.get_final_response()
    assert completed.type == "response.completed" and final.store is True
    retrieved = stored.responses.retrieve(final.id)
    # The stream's parsed items carry the client's own `parsed` fields: the output is compared item by item.
    assert retrieved.model_dump(exclude={"output"}) == completed.response.model_dump(exclude={"output"})
    assert [(i.id, i.status) for i in retrieved.output] == [(i.id, i.status) for i in final.output]
    assert retrieved.output_text == final.output_text
    with stored.responses.stream(model=MODEL, input="Go on", previous_response_id=final.id, **GREEDY) as stream:
        continued = stream.get_final_response()
    explicit = stored.responses.create(model=MODEL, store=False, **GREEDY, input=[
        user("Tell me a story"), assistant(final.output_text), user("Go on")])
    assert_same_answer(continued, explicit)


def test_retrieve_and_delete(stored):
    response = stored.responses.create(model=MODEL, input="Hi", **GREEDY)
    assert stored.responses.retrieve(response.id).model_dump() == response.model_dump()
    assert stored.responses.delete(response.id) is None
    for call in (lambda: stored.responses.retrieve(response.id), lambda: stored.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["param"] == "response_id" and caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        stored.responses.create(model=MODEL, input="And?", previous_response_id=response.id, **GREEDY)
    assert caught.value.body["param"] == "previous_response_id" and response.id in caught.value.body["message"]


def test_store_false_keeps_nothing(stored):
    response = stored.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        stored.responses.retrieve(response.id)


def test_the_least_recently_used_is_dropped_at_the_bound(stored):
    ids = [stored.responses.create(model=MODEL, input=f"Turn {i}", max_output_tokens=1).id
           for i in range(MAX_ENTRIES)]
    stored.responses.retrieve(ids[0])  # used: now the most recent
    ids.append(stored.responses.create(model=MODEL, input="One more", max_output_tokens=1).id)
    with pytest.raises(openai.NotFoundError):
        stored.responses.retrieve(ids[1])
    with pytest.raises(openai.NotFoundError) as caught:
        stored.responses.create(model=MODEL, input="Go on", previous_response_id=ids[1], max_output_tokens=1)
    assert caught.value.body["param"] == "previous_response_id"
    for kept in (ids[0], *ids[2:]):
        assert stored.responses.retrieve(kept).id == kept


def test_a_tool_round_trip_by_previous_response_id(scripted):
    server, runner = scripted
    shared = storing(server)
    client = shared.client()
    runner.script = CALL
    try:
        asked = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
        (call,) = asked.output
        assert call.type == "function_call"
        runner.script = "Sunny."
        continued = client.responses.create(model=MODEL, tools=[WEATHER], previous_response_id=asked.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        explicit = client.responses.create(model=MODEL, tools=[WEATHER], store=False, input=[
            user("Weather in Paris?"), call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        assert continued.output_text == "Sunny."
        assert continued.usage.input_tokens == explicit.usage.input_tokens
    finally:
        runner.script = "Hello!"
        shared.stop()


def test_background_and_cancel_are_refused(stored, openai_server):
    response = stored.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as caught:
        stored.responses.cancel(response.id)
    assert caught.value.body["code"] == "not_cancellable"
    with pytest.raises(openai.NotFoundError):
        stored.responses.cancel("resp_unknown")
    for client in (stored, openai_server.client()):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="Hi", background=True)
        assert caught.value.body["param"] == "background"
        assert client.responses.create(model=MODEL, input="Hi", background=False, max_output_tokens=1).output


def test_retrieving_refuses_what_it_cannot_do_by_name(stored):
    response = stored.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    for query, param in (({"stream": "true"}, "stream"), ({"include[]": "message.output_text.logprobs"},
                                                           "include[]"), ({"starting_after": "3"}, "starting_after")):
        with pytest.raises(openai.BadRequestError) as caught:
            stored.responses.retrieve(response.id, extra_query=query)
        assert caught.value.body["param"] == param
    assert stored.responses.retrieve(response.id, extra_query={"stream": "false"}).id == response.id


@pytest.mark.parametrize(("body", "param"), [({"store": True}, "store"),
                                             ({"previous_response_id": "resp_1"}, "previous_response_id")])
def test_with_the_store_off_asking_for_it_is_refused_by_name(openai_server, body, param):
    reply = HTTP.post(f"{openai_server.base_url}/v1/responses", headers=openai_server.headers,
                      json={"model": MODEL, "input": "Hi", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "--enable-response-store" in error["message"]


def test_with_the_store_off_a_request_that_leaves_store_out_works(openai_server):
    client = openai_server.client()
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    assert response.store is False
    for call in (lambda: client.responses.retrieve(response.id), lambda: client.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert "--enable-response-store" in caught.value.body["message"]


def test_the_flags_reach_the_config_and_the_bound_is_checked():
    args = build_parser().parse_args(["serve", "--enable-response-store", "--response-store-max-entries", "7"])
    config = _server_config(args)
    assert config.enable_response_store is True and config.response_store_max_entries == 7
    defaults = _server_config(build_parser().parse_args(["serve"]))
    assert defaults.enable_response_store is False
    with pytest.raises(ConfigError, match="response_store_max_entries"):
        ServerConfig(response_store_max_entries=0)


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, ()))
    assert store.get("a") is not None
    store.put(StoredResponse({"id": "c"}, ()))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 1
