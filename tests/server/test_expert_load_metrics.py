"""The opt-in expert-load series: `kestrel:moe_expert_tokens_total{layer, expert}` (and its `vllm:` copy) on
/metrics of a server whose engine counts, absent otherwise."""

from conftest import API_KEY, MODEL, LiveServer
from http_client import HTTP

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app
from kestrel.loader.model_init import write_tiny_checkpoint

SERIES = "kestrel:moe_expert_tokens_total{"


def serve(model_dir: str, **engine_args) -> LiveServer:
    engine = AsyncEngine.from_args(model_dir, max_model_len=128, device="cpu", dtype="float32",
                                   **engine_args).start()
    return LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)


def samples(server: LiveServer) -> dict[str, float]:
    text = HTTP.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith((SERIES, "vllm:moe_expert_tokens_total{"))}


def test_expert_series_count_every_routed_token(tmp_path):
    write_tiny_checkpoint(tmp_path, "qwen3_moe", seed=1)
    server = serve(str(tmp_path), expert_load_metrics=True, expert_load_interval=1)
    try:
        reply = HTTP.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                          json={"model": MODEL, "prompt": "a b c d e", "max_tokens": 5, "temperature": 0.0,
                                 "ignore_eos": True})
        assert reply.status_code == 200
        prompt_tokens = reply.json()["usage"]["prompt_tokens"]
        server.wait_idle()
        found = samples(server)
        ours = {name: v for name, v in found.items() if name.startswith(SERIES)}
        assert len(ours) == 2 * 4  # two MoE layers of four experts
        assert 'layer="0"' in next(iter(ours)) and 'expert="0"' in next(iter(ours))
        # Two experts a token, every computed token: the prompt and the four generated tokens fed back.
        for layer in ("0", "1"):
            assert sum(v for name, v in ours.items() if f'layer="{layer}"' in name) == 2 * (prompt_tokens + 4)
        assert sum(v for name, v in found.items() if name.startswith("vllm:")) == sum(ours.values())
    finally:
        server.stop()


def test_no_series_without_the_flag(tmp_path):
    write_tiny_checkpoint(tmp_path, "qwen3_moe", seed=1)
    server = serve(str(tmp_path))
    try:
        assert samples(server) == {}
    finally:
        server.stop()
