"""`kestrel serve`'s vLLM-style server settings: several API keys and served names, CORS, a chat template given
to the server, auto tool choice switched off, and the settings' own validation."""

import pytest
from conftest import LiveServer, scripted_engine
from http_client import HTTP

from kestrel.config import ConfigError
from kestrel.entrypoints.server import build_app
from kestrel.entrypoints.server_config import ServerConfig

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def server(tiny_model_dir, request):
    started = []

    def start(names=("tiny",), keys=("k1",), **settings):
        engine, _ = scripted_engine(tiny_model_dir)
        live = LiveServer(build_app(engine, names, keys, **settings), engine, api_key=keys[0] if keys else None)
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


def test_every_api_key_is_accepted_and_others_are_not(server):
    live = server(keys=("k1", "k2"))
    for key, status in (("k1", 200), ("k2", 200), ("k3", 401)):
        response = HTTP.get(f"{live.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == status


def test_every_served_name_is_listed_accepted_and_echoed(server):
    live = server(names=("main", "alias"))
    models = HTTP.get(f"{live.base_url}/v1/models", headers=live.headers).json()["data"]
    assert [m["id"] for m in models] == ["main", "alias"]
    body = {"prompt": "hi", "max_tokens": 2}
    for asked, reported in ((None, "main"), ("alias", "alias"), ("main", "main")):
        reply = HTTP.post(f"{live.base_url}/v1/completions", headers=live.headers,
                          json={**body, **({"model": asked} if asked else {})}).json()
        assert reply["model"] == reported
    missing = HTTP.post(f"{live.base_url}/v1/completions", headers=live.headers, json={**body, "model": "other"})
    assert missing.status_code == 404


def test_cors_headers_only_when_origins_are_allowed(server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    plain = server()
    assert "access-control-allow-origin" not in HTTP.options(f"{plain.base_url}/v1/completions",
                                                               headers=preflight).headers
    cors = server(allowed_origins=("https://app.example",))
    reply = HTTP.options(f"{cors.base_url}/v1/completions", headers=preflight)
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"


def test_a_server_chat_template_replaces_the_tokenizers(server, tiny_model_dir):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
    live = server(chat_template=template)
    reply = HTTP.post(f"{live.base_url}/tokenize", headers=live.headers, json={"messages": MESSAGES}).json()
    from kestrel.loader.tokenizer import load_tokenizer

    expected = load_tokenizer(tiny_model_dir).encode("<<hi>>=>", add_special_tokens=False)
    assert reply["tokens"] == expected


def test_auto_tool_choice_can_be_switched_off(server):
    live = server(enable_auto_tool_choice=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    reply = HTTP.post(f"{live.base_url}/v1/chat/completions", headers=live.headers,
                      json={"messages": MESSAGES, "tools": tools, "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"
    named = HTTP.post(f"{live.base_url}/v1/chat/completions", headers=live.headers,
                      json={"messages": MESSAGES, "tools": tools, "max_tokens": 2,
                             "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named.status_code == 200


@pytest.mark.parametrize("settings, match", [
    ({"ssl_keyfile": "/k.pem"}, "both ssl_keyfile and ssl_certfile"),
    ({"shutdown_timeout": 0}, "shutdown_timeout=0"),
    ({"keep_alive_timeout": 0}, "keep_alive_timeout=0"),
    ({"tool_call_parser": "xml"}, "tool_call_parser='xml'"),
    ({"chat_template": "not-a-file"}, "chat_template='not-a-file'"),
])
def test_bad_settings_are_config_errors(settings, match):
    with pytest.raises(ConfigError, match=match):
        ServerConfig(**settings).chat_template_text()


def test_the_startup_summary_names_what_runs(server):
    from kestrel.entrypoints.server import startup_summary

    live = server()
    text = "\n".join(startup_summary(live.engine))
    assert "KV cache: 256 blocks of 16 tokens (4,096 tokens" in text and "max_model_len 512: 8.0x" in text
    assert "quantization none" in text
