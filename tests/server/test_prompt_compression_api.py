"""prompt_compression on /v1/completions and /v1/chat/completions through the openai client: kestrel-tiny serves
and compresses in one in-process server. Usage before and after, the prefix cache, the 400s, the metrics."""

import concurrent.futures
import inspect
import json
import threading

import httpx
import pytest
from conftest import API_KEY, MODEL, LiveServer, start_core_process_server
from http_client import HTTP

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app
from kestrel.sampling_params import SamplingParams
from kestrel.tiny import BUNDLED_MODEL_DIR

SOURCE = inspect.getsource(json.dumps)[:1500]


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine.from_args(str(BUNDLED_MODEL_DIR), prompt_compressor="kestrel-tiny", device="cpu",
                                   dtype="float32", max_model_len=512, enable_prefix_caching=True).start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY, enable_prompt_tokens_details=True), engine)
    yield live
    live.stop()


def test_completion_reports_both_counts_and_hits_the_prefix_cache(server):
    client = server.client()
    body = {"prompt_compression": {"rate": 0.5}}
    first = client.completions.create(model=MODEL, prompt=SOURCE, max_tokens=4, temperature=0, extra_body=body)
    second = client.completions.create(model=MODEL, prompt=SOURCE, max_tokens=4, temperature=0, extra_body=body)
    plain = client.completions.create(model=MODEL, prompt=SOURCE[:400], max_tokens=1, temperature=0)
    original = first.usage.model_extra["original_prompt_tokens"]
    assert abs(first.usage.prompt_tokens / original - 0.5) <= 0.08
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert "original_prompt_tokens" not in (plain.usage.model_extra or {})  # asked for nothing, reports nothing


def test_streamed_chat_keeps_the_last_turn_and_reports_usage(server):
    client = server.client()
    question = "What does json.dumps do with indent?"
    messages = [{"role": "user", "content": SOURCE}, {"role": "assistant", "content": "That is json.dumps."},
                {"role": "user", "content": question}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"prompt_compression": {"rate": 0.4},
                                                            "return_token_ids": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens < 0.7 * usage.model_extra["original_prompt_tokens"]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                           extra_body={"prompt_compression": {"rate": 0.4},
                                                       "return_token_ids": True})
    prompt = server.engine.tokenizer.decode(whole.model_extra["prompt_token_ids"])
    assert question in prompt and SOURCE not in prompt
    assert whole.usage.prompt_tokens == usage.prompt_tokens


@pytest.mark.parametrize("path, extra, param", [
    ("completions", {"prompt_compression": {"rate": 0}}, "prompt_compression.rate"),
    ("completions", {"prompt_compression": {"rate": 1.5}}, "prompt_compression.rate"),
    ("completions", {"prompt_compression": {"rate": 0.5, "level": 2}}, "prompt_compression.level"),
    ("completions", {"prompt_compression": {"keep_system": True}}, "prompt_compression.rate"),
    ("completions", {"prompt_compression": {"rate": 0.5, "keep_system": True}}, "prompt_compression.keep_system"),
    ("completions", {"prompt_compression": {"rate": 0.5}, "prompt": [1, 2, 3]}, "prompt_compression"),
    ("completions", {"prompt_compression": {"rate": 0.5, "keep_spans": [[0, 9999]]}},
     "prompt_compression.keep_spans"),
    ("completions", {"prompt_compression": {"rate": 0.5, "keep_spans": [[0, 2]]}, "prompt": ["ab", "cd"]},
     "prompt_compression.keep_spans"),
    ("chat/completions", {"prompt_compression": {"rate": 0.5, "keep_spans": [[0, 2]]}},
     "prompt_compression.keep_spans"),
])
def test_bad_options_are_400s_naming_the_field(server, path, extra, param):
    body = {"model": MODEL, "max_tokens": 1, **({"messages": [{"role": "user", "content": SOURCE}]}
                                                if path.startswith("chat") else {"prompt": SOURCE}), **extra}
    reply = HTTP.post(f"{server.base_url}/v1/{path}", headers=server.headers, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_a_server_without_compressor_answers_400_naming_the_flag(scripted, path):
    live, _ = scripted
    body = {"model": MODEL, "max_tokens": 1, "prompt_compression": {"rate": 0.5},
            **({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})}
    reply = HTTP.post(f"{live.base_url}/v1/{path}", headers=live.headers, json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt_compression" and "--prompt-compressor" in error["message"]


def test_the_engine_refuses_a_request_still_asking_for_compression(server):
    with pytest.raises(ValueError, match="prompt_compression"):
        server.engine.submit("raw", [1, 2, 3], SamplingParams(prompt_compression={"rate": 0.5}))


def test_metrics_count_saved_tokens_and_time_under_both_prefixes(server):
    before = server.metrics()
    reply = HTTP.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                      json={"model": MODEL, "prompt": SOURCE, "max_tokens": 1, "prompt_compression": {"rate": 0.5}})
    usage = reply.json()["usage"]
    after = server.metrics()
    saved = usage["original_prompt_tokens"] - usage["prompt_tokens"]
    for prefix in ("kestrel:", "vllm:"):
        name = prefix + "prompt_compression_saved_tokens_total"
        assert after[name] - before.get(name, 0.0) == saved > 0
        count = prefix + "prompt_compression_seconds_count"
        assert after[count] - before.get(count, 0.0) == 1
        assert after[prefix + "prompt_compression_seconds_sum"] > before.get(prefix + "prompt_compression_seconds_sum",
                                                                             0.0)


def test_engine_core_process_server_compresses_with_another_tokenizer(tiny_model_dir):
    """The compressor (kestrel-tiny's tokenizer) beside a served model with a tokenizer of its own, in the API
    process of a server whose engine core is a process of its own."""
    live = start_core_process_server(tiny_model_dir, prompt_compressor="kestrel-tiny", max_model_len=512)
    try:
        assert live.engine.prompt_compressor.tokenizer.vocab_size != live.engine.tokenizer.vocab_size
        reply = HTTP.post(f"{live.base_url}/v1/completions", headers=live.headers, timeout=120,
                          json={"model": MODEL, "prompt": SOURCE[:800], "max_tokens": 2,
                                 "prompt_compression": {"rate": 0.5}})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert 0.3 < usage["prompt_tokens"] / usage["original_prompt_tokens"] < 0.7
    finally:
        live.stop()


def test_a_compression_in_progress_holds_up_neither_the_loop_nor_other_requests(server, monkeypatch):
    compressor = server.engine.prompt_compressor
    started, release = threading.Event(), threading.Event()
    real = compressor.compress_text

    def slow(*args, **kwargs):
        started.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(compressor, "compress_text", slow)
    body = {"model": MODEL, "prompt": SOURCE, "max_tokens": 1, "prompt_compression": {"rate": 0.5}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        compressed = pool.submit(httpx.post, f"{server.base_url}/v1/completions", headers=server.headers, json=body,
                                 timeout=60)
        assert started.wait(30)
        plain = HTTP.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=30,
                          json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
        assert plain.status_code == 200 and not compressed.done()
        release.set()
        assert compressed.result().status_code == 200
