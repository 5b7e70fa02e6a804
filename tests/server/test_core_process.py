"""The engine core in its own process (`--engine-core-process`): the server's behaviour is unchanged (the OpenAI
suite of test_openai_api.py runs on it too), structured outputs, abort and metrics cross the process boundary,
delta outputs are rebuilt in the client, and the core's failures are clean: a killed core fails every request with
an engine error and /health turns 503, a core that cannot start reports the same ConfigError as the in-process
engine, and no core outlives its server."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from conftest import (
    API_KEY,
    MODEL,
    SCRIPTED_BLOCKS,
    ScriptedRunner,
    scripted_engine,
    serve_process,
    start_core_process_server,
)
from delta_outputs import check_joined_deltas
from http_client import HTTP

from kestrel import SamplingParams
from kestrel.bench.soak import process_tree
from kestrel.config import ConfigError, EngineConfig
from kestrel.engine.core import EngineCore
from kestrel.entrypoints.async_engine import EngineDeadError
from kestrel.entrypoints.core_client import CORE_FAILED_MESSAGE, CoreClient
from kestrel.entrypoints.core_process import PROCESS_NAME, _CoreLoop
from kestrel.entrypoints.core_protocol import ERROR, SHUTDOWN, STEP, pack, unpack
from kestrel.loader.tokenizer import load_tokenizer

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SCHEMA = {"type": "object", "properties": {"language": {"enum": ["python", "c", "rust"]}, "typed": {"type": "boolean"}},
          "required": ["language", "typed"], "additionalProperties": False}


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return HTTP.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, headers=HEADERS, timeout=60)


def exited(pid: int, within_s: float = 10.0) -> bool:
    """The process has ended (gone, or a zombie waiting for whoever adopted it to reap it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # reaped before the read, or during it
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_structured_outputs_are_compiled_and_matched_in_the_core(core_process_server):
    check_structured_outputs(core_process_server)


def test_structured_outputs_and_forced_tool_calls_with_grammar_workers_in_the_core(tiny_model_dir):
    """The core's matchers in two grammar worker processes (`--grammar-workers 2`): the same checks, and a forced
    tool call, whose grammar reaches the core as its source and the workers as the compiled grammar's text."""
    server = start_core_process_server(tiny_model_dir, grammar_workers=2, max_model_len=512)
    try:
        check_structured_outputs(server)
        tool = {"type": "function", "function": {"name": "set_level", "parameters": {
            "type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["level"], "additionalProperties": False}}}
        body = {"messages": [{"role": "user", "content": "Set a level."}], "max_tokens": 60, "seed": 2,
                "tools": [tool], "tool_choice": "required", "temperature": 1.0}
        answer = post(server, body, "/v1/chat/completions")
        assert answer.status_code == 200, answer.text
        calls = answer.json()["choices"][0]["message"]["tool_calls"]
        assert calls and calls[0]["function"]["name"] == "set_level"
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), tool["function"]["parameters"])
    finally:
        server.stop()


def check_structured_outputs(server) -> None:
    core_process_server = server
    choice = post(core_process_server, {"prompt": "Pick:", "max_tokens": 20, "temperature": 1.0, "seed": 3,
                                        "structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.status_code == 200, choice.text
    assert choice.json()["choices"][0]["text"] in ("yes", "no", "maybe")
    regex = post(core_process_server, {"prompt": "Code:", "max_tokens": 20, "temperature": 1.0, "seed": 5,
                                       "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert regex.status_code == 200 and re.fullmatch("[A-Z]{3}-[0-9]{2}", regex.json()["choices"][0]["text"])
    fmt = {"type": "json_schema", "json_schema": {"name": "language", "schema": SCHEMA, "strict": True}}
    body = {"messages": [{"role": "user", "content": "Describe a language."}], "max_tokens": 120, "seed": 1,
            "response_format": fmt, "n": 2, "temperature": 1.0}
    answer = post(core_process_server, body, "/v1/chat/completions")
    assert answer.status_code == 200, answer.text
    for c in answer.json()["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    bad = post(core_process_server, {"prompt": "x", "max_tokens": 5, "structured_outputs": {"regex": "(unclosed"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("structured_outputs")


def test_a_client_that_goes_away_aborts_its_request_in_the_core(core_process_server):
    before = core_process_server.wait_idle()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", f"{core_process_server.base_url}/v1/completions", json=body, headers=HEADERS,
                     timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and "choices" in line:
                break
    samples = core_process_server.wait_idle()
    assert samples["kestrel:num_requests_running"] == 0 and samples["kestrel:kv_cache_usage_perc"] == 0
    assert core_process_server.engine.num_unfinished == 0
    assert samples["kestrel:generation_tokens_total"] - before["kestrel:generation_tokens_total"] < 200


def test_metrics_are_the_cores_stats(core_process_server):
    before = core_process_server.metrics()
    reply = post(core_process_server, {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True})
    assert reply.status_code == 200
    after = core_process_server.wait_idle()
    usage = reply.json()["usage"]
    assert after["kestrel:prompt_tokens_total"] - before["kestrel:prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["kestrel:generation_tokens_total"] - before["kestrel:generation_tokens_total"] == 6
    assert after["kestrel:iteration_tokens_total_count"] > before["kestrel:iteration_tokens_total_count"]
    assert after["kestrel:engine_healthy"] == 1


def test_a_killed_core_fails_every_request_and_health_turns_503(tiny_model_dir):
    server = start_core_process_server(tiny_model_dir)
    try:
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
            with HTTP.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=HEADERS,
                             timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first.wait(30)
        os.kill(server.engine.pid, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after its engine died"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and error["message"] == CORE_FAILED_MESSAGE
        later = post(server, {"prompt": "hi", "max_tokens": 4})
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
        assert "engine core process" in later.json()["error"]["message"]
        health = HTTP.get(f"{server.base_url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert server.metrics()["kestrel:engine_healthy"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("where", ["engine_core_process", "in_process"])
def test_a_submit_racing_the_engines_death_is_refused_not_left_waiting(tiny_model_dir, where):
    """The engine stops (every request failed) between a submit's liveness check and its registration: the submit
    is refused under the same lock, where its stream would otherwise wait for a reply nobody sends."""
    if where == "in_process":
        engine, _ = scripted_engine(tiny_model_dir)
    else:
        engine = CoreClient.from_args(tiny_model_dir, max_model_len=256, device="cpu", dtype="float32")
    try:
        engine._check_alive()  # the submit's check passes...
        engine._fail_all(EngineDeadError("the engine was shut down"))  # ...then the engine fails every request
        async def late_request() -> list:
            return [output async for output in engine.generate("late", [5, 6, 7], SamplingParams(max_tokens=2))]

        with pytest.raises(EngineDeadError, match="shut down"):
            asyncio.run(asyncio.wait_for(late_request(), 10))
    finally:
        engine.shutdown()


async def generate_once_free(engine: Any, free: Callable[[], bool], params: SamplingParams) -> list:
    """Request "r1" again once `free()` says its abort was applied (10 s at most)."""
    deadline = time.monotonic() + 10
    while not free() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return [output async for output in engine.generate("r1", [5, 6, 7], params)]


def three_tokens_for_r1(engine: Any, main: Callable[[], Coroutine[Any, Any, list]]) -> None:
    try:
        outputs = asyncio.run(asyncio.wait_for(main(), 30))
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
    finally:
        engine.shutdown()


def test_an_aborted_id_is_free_again_only_once_the_abort_is_applied(tiny_model_dir):
    """A step in flight may still answer for an aborted request: until the engine thread applies the abort, a new
    request may not take its id (its stream would get the old request's outputs)."""
    engine, _ = scripted_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def main() -> list:
        engine.submit("r1", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        with engine._cond:  # the engine thread cannot apply the abort meanwhile
            engine.abort("r1")
            with pytest.raises(ValueError, match="'r1' is still in use"):
                engine.submit("r1", [5, 6, 7], params)
        return await generate_once_free(engine, lambda: "r1" not in engine._aborting, params)

    three_tokens_for_r1(engine, main)


def test_the_core_clients_aborted_id_is_free_again_once_the_core_applied_the_abort(tiny_model_dir):
    """The core process answers for a sequence until it reads the abort: until a step says it applied it, a new
    request may not take the aborted request's id (the old sequence's tokens would be taken for the new one's)."""
    client = CoreClient.from_args(tiny_model_dir, max_model_len=256, device="cpu", dtype="float32").start()
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def main() -> list:
        stream = client.submit("r1", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.accepted()
        with client._send_lock:  # the abort cannot reach the core meanwhile
            aborting = threading.Thread(target=client.abort, args=("r1",))
            aborting.start()
            deadline = time.monotonic() + 10
            while "r1" not in client._aborting.values() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            with pytest.raises(ValueError, match="'r1' is still in use"):
                client.submit("r1", [5, 6, 7], params)
        aborting.join(10)
        return await generate_once_free(client, lambda: not client._aborting, params)

    three_tokens_for_r1(client, main)


def test_a_core_that_stops_reading_does_not_hold_the_servers_event_loop(tiny_model_dir):
    """A live core that stops reading (stopped here) lets its pipe fill: the submits that would fill it past its
    buffer still return at once (a writer thread waits, not the event loop), and the core serves them all once
    it reads again."""
    client = CoreClient.from_args(tiny_model_dir, max_model_len=256, device="cpu", dtype="float32").start()
    params = SamplingParams(max_tokens=1)
    prompt = [5 + i % 50 for i in range(200)]

    async def main() -> float:
        os.kill(client.pid, signal.SIGSTOP)
        resume = threading.Timer(10, os.kill, (client.pid, signal.SIGCONT))  # a submit that blocks fails, not hangs
        resume.start()
        try:
            started = time.monotonic()
            streams = [client.submit(f"r{i}", prompt, params) for i in range(2000)]  # megabytes of ADD messages
            submitted_s = time.monotonic() - started
        finally:
            resume.cancel()
            os.kill(client.pid, signal.SIGCONT)
        for stream in streams:
            assert [output async for output in stream][-1].finished
        return submitted_s

    try:
        assert asyncio.run(asyncio.wait_for(main(), 120)) < 10
    finally:
        client.shutdown()


def test_a_core_that_fails_mid_run_reports_its_error_after_the_steps_before_it(tiny_model_dir):
    """The pipe has one writer: the error goes out after the steps queued before it, whole (two writers could
    interleave a long step's bytes with the error's)."""
    config = EngineConfig.from_kwargs(tiny_model_dir, max_model_len=256, kv_cache_blocks=SCRIPTED_BLOCKS,
                                      device="cpu")
    tokenizer = load_tokenizer(tiny_model_dir)
    runner = ScriptedRunner(tokenizer, int(config.model.hf_config["vocab_size"]))
    core = EngineCore(config, runner, SCRIPTED_BLOCKS, tokenizer, tokenizer.eos_token_id)
    steps = 0

    def step() -> list:
        nonlocal steps
        steps += 1
        if steps == 4:
            raise RuntimeError("the device fell off the bus")
        return []

    core.step, core.has_unfinished_requests = step, lambda: True
    ours, theirs = multiprocessing.Pipe()
    loop = _CoreLoop(core, theirs)
    with pytest.raises(RuntimeError, match="fell off the bus"):
        loop.run()
    messages = []
    while ours.poll(1.0):
        messages.append(unpack(ours.recv_bytes()))
    for conn in (ours, theirs, loop._wake, loop._wake_writer):
        conn.close()
    assert [m[0] for m in messages] == [STEP, STEP, STEP, ERROR]
    assert messages[-1][1][:2] == ["RuntimeError", "the device fell off the bus"]


def test_shutdown_reaps_the_core(tiny_model_dir):
    server = start_core_process_server(tiny_model_dir)
    pid = server.engine.pid
    assert post(server, {"prompt": "hi", "max_tokens": 3}).status_code == 200
    server.stop()
    assert not Path(f"/proc/{pid}").exists(), "the core was not reaped"


def test_a_core_that_cannot_start_reports_the_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="kv_cache_blocks"):
        CoreClient.from_args(tiny_model_dir, max_model_len=256, kv_cache_blocks=2, device="cpu", dtype="float32")


def _descendants(pid: int) -> list[int]:
    """Children, grandchildren, ...: an executor's ranks run under the core."""
    return process_tree(pid)[1:]


def _name(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().strip()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _cores(pid: int) -> list[int]:
    return [p for p in _descendants(pid) if _name(p) == PROCESS_NAME]


def test_the_core_dies_with_its_server(tiny_model_dir):
    """`kestrel serve --engine-core-process` killed outright (no drain, no clean-up): its core exits too."""
    with serve_process(tiny_model_dir, "--engine-core-process", "--tokenizer-workers", "0",
                       "--grammar-compile-workers", "0", "--max-model-len", "256") as (process, base):
        reply = HTTP.post(f"{base}/v1/completions", headers=HEADERS, timeout=60,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert reply.status_code == 200
        descendants = _descendants(process.pid)  # the core, multiprocessing's fork server and resource tracker
        assert _cores(process.pid), "no engine core process under the server"
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        for pid in descendants:
            assert exited(pid), f"process {pid} outlived its server"


def test_embeddings_and_prompt_logprobs_are_the_in_process_engines(openai_server, core_process_server):
    texts = ["The quick brown fox", "a"]
    body = {"input": texts, "encoding_format": "float"}
    here, there = (post(s, body, "/v1/embeddings").json()["data"] for s in (openai_server, core_process_server))
    for a, b in zip(here, there):
        assert max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"])) < 1e-5
    scored = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0.0, "echo": True, "logprobs": 2,
              "n": 2, "stop": ["zzz"], "ignore_eos": True}
    here, there = (post(s, scored).json()["choices"] for s in (openai_server, core_process_server))
    for a, b in zip(here, there):
        assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_core_process_by_default_only_for_a_cpu_text_model_in_one_process(tiny_model_dir, monkeypatch):
    from kestrel.entrypoints import engine_factory

    config = engine_factory.engine_config(tiny_model_dir, device="cpu", dtype="float32", max_model_len=256)
    assert engine_factory.core_process_by_default(config)
    parallel = engine_factory.engine_config(tiny_model_dir, device="cpu", dtype="float32", max_model_len=256,
                                            tensor_parallel_size=2)
    assert not engine_factory.core_process_by_default(parallel)
    monkeypatch.setattr(engine_factory, "model_modalities", lambda config: frozenset({"image"}))
    assert not engine_factory.core_process_by_default(config)


@pytest.mark.parametrize("flag", [(), ("--no-engine-core-process",)], ids=["default", "off"])
def test_kestrel_serve_on_the_cpu_splits_the_core_unless_told_not_to(tiny_model_dir, flag):
    with serve_process(tiny_model_dir, *flag, "--device", "cpu", "--tokenizer-workers", "0",
                       "--grammar-compile-workers", "0", "--max-model-len", "256") as (process, base):
        reply = HTTP.post(f"{base}/v1/completions", headers=HEADERS, timeout=60,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert reply.status_code == 200
        assert bool(_cores(process.pid)) == (not flag)


def test_a_forced_tool_call_is_compiled_in_the_core(core_process_server):
    """tool_choice "required": the call's grammar travels as its source and the core compiles it (the API process
    holds no compiled grammar to hand over)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    reply = post(core_process_server, {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool],
                                       "tool_choice": "required", "max_tokens": 40, "temperature": 0.0},
                 "/v1/chat/completions")
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "f"
        assert isinstance(json.loads(call["arguments"]), dict)
    else:  # out of tokens mid-call: the constrained text so far is the start of the call
        assert choice["finish_reason"] == "length"


def test_delta_outputs_from_the_core_join_to_the_cumulative_ones(core_process_server):
    """output_kind="delta" through the engine core process (the client builds the outputs from the core's token
    deltas): n = 2 sampled sequences with logprobs, prompt logprobs and a stop string, read as they come."""
    engine = core_process_server.engine
    cumulative = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16, logprobs=2, prompt_logprobs=1,
                                stop=["\n"])

    async def outputs(params: SamplingParams, request_id: str) -> list:
        return [out async for out in engine.generate(request_id, [5, 6, 7, 8], params)]

    async def main() -> tuple[list, list]:
        return await asyncio.gather(outputs(cumulative, "cumulative"),
                                    outputs(cumulative.replace(output_kind="delta"), "delta"))

    whole, deltas = asyncio.run(asyncio.wait_for(main(), 60))
    check_joined_deltas(deltas, whole[-1])


def test_a_stop_tokens_text_is_left_out_through_the_core_process(core_process_server):
    """The client detokenizes the core's tokens: a sequence ended by a stop token id keeps the token, not its text,
    unless include_stop_str_in_output; its cumulative text only grows."""
    engine = core_process_server.engine
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("def __init__(self")

    async def outputs(params: SamplingParams, request_id: str) -> list:
        return [out async for out in engine.generate(request_id, prompt, params)]

    plain = asyncio.run(outputs(SamplingParams(max_tokens=16, temperature=0), "plain"))[-1].outputs[0]
    stop = plain.token_ids[3]
    cut = plain.token_ids.index(stop) + 1
    for include in (False, True):
        params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop], include_stop_str_in_output=include)
        steps = asyncio.run(outputs(params, f"stop-token-{include}"))
        final = steps[-1].outputs[0]
        assert final.token_ids == plain.token_ids[:cut] and final.stop_reason == stop
        assert final.text == tokenizer.decode(plain.token_ids[:cut if include else cut - 1])
        texts = [out.outputs[0].text for out in steps]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize("output_kind", ["cumulative", "delta", "final_only"])
def test_an_abort_by_id_ends_the_readers_stream_through_the_core_process(core_process_server, output_kind):
    """As in process (tests/server/test_async_engine.py): the reader of a request aborted by its id gets the final
    output, finish_reason "abort", with the text of what was generated so far (a final-only request's too)."""
    engine = core_process_server.engine
    tokenizer = engine.tokenizer
    # The server's whole context (MAX_MODEL_LEN): a fast host decodes 200 tokens in the 0.2 s a fixed wait took.
    params = SamplingParams(max_tokens=240, ignore_eos=True, temperature=0.0, output_kind=output_kind)

    async def run() -> list:
        seen = []
        generated_before = engine.stats().num_generation_tokens

        async def read():
            async for out in engine.generate(f"abort-{output_kind}", tokenizer.encode("import os"), params):
                seen.append(out)

        reader = asyncio.create_task(read())
        for _ in range(2500):  # a few tokens out (a final-only request shows none: the engine's count says so)
            if len(seen) >= 3 or engine.stats().num_generation_tokens - generated_before >= 3:
                break
            await asyncio.sleep(0.002)
        engine.abort(f"abort-{output_kind}")
        await asyncio.wait_for(reader, 10)
        return seen

    seen = asyncio.run(run())
    final = seen[-1].outputs[0]
    assert seen[-1].finished and final.finish_reason == "abort"
    tokens = [t for out in seen for t in out.outputs[0].delta_token_ids] if output_kind == "delta" else final.token_ids
    text = "".join(out.outputs[0].delta_text for out in seen) if output_kind == "delta" else final.text
    assert tokens and text == tokenizer.decode(tokens)


class _RunnerWithPendingGraphs(ScriptedRunner):
    """A scripted runner with graphs left to capture (graph_capture="serving"), one per call."""

    def __init__(self, *args: Any, pending: int = 5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending = pending
        self.captured = 0

    @property
    def graphs_pending(self) -> bool:
        return self.captured < self.pending

    def capture_next_graph(self) -> None:
        self.captured += 1


def test_an_idle_core_captures_its_pending_graphs_without_a_message(tiny_model_dir):
    """The core process's loop with no request: it captures the pending graphs one per turn, without waiting on
    the pipe while any is left, then waits there; SHUTDOWN ends it."""
    config = EngineConfig.from_kwargs(tiny_model_dir, max_model_len=256, kv_cache_blocks=SCRIPTED_BLOCKS,
                                      device="cpu")
    tokenizer = load_tokenizer(tiny_model_dir)
    runner = _RunnerWithPendingGraphs(tokenizer, int(config.model.hf_config["vocab_size"]))
    core = EngineCore(config, runner, SCRIPTED_BLOCKS, tokenizer, tokenizer.eos_token_id)
    assert core.has_idle_work
    ours, theirs = multiprocessing.Pipe()
    loop = _CoreLoop(core, theirs)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while runner.graphs_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.captured == runner.pending and not core.has_idle_work
    time.sleep(0.2)
    assert thread.is_alive()  # waiting for a message, not spinning out
    ours.send_bytes(pack([SHUTDOWN]))
    thread.join(10)
    assert not thread.is_alive()
    for conn in (ours, theirs, loop._wake, loop._wake_writer):
        conn.close()
