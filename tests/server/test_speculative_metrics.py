"""Speculative decoding's Prometheus series under vLLM's spec_decode names, with acceptance counted."""

import pytest
from conftest import API_KEY, MODEL, LiveServer
from http_client import HTTP

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_spec_decode_series_count_drafts_and_acceptance(tiny_model_dir, method):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "draft_model":  # the model drafting for itself: every draft is accepted
        spec = {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 3}
    engine = AsyncEngine.from_args(tiny_model_dir, max_model_len=256, device="cpu", dtype="float32",
                                   speculative_config=spec).start()
    server = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    try:
        reply = HTTP.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                          json={"model": MODEL, "prompt": "a b c a b c a b c a b", "max_tokens": 40,
                                 "temperature": 0.0, "ignore_eos": True})
        assert reply.status_code == 200
        metrics = server.wait_idle()
        drafts = metrics["vllm:spec_decode_num_draft_tokens_total"]
        accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and 0 <= accepted <= drafts and metrics["vllm:spec_decode_num_drafts_total"] > 0
        assert method != "draft_model" or accepted == drafts
        text = HTTP.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10).text
        per_position = [line for line in text.splitlines()
                        if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
        assert per_position and sum(float(line.split()[-1]) for line in per_position) == accepted
        assert 'position="0"' in per_position[0]
    finally:
        server.stop()
