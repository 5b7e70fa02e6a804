"""guidellm, the vLLM project's load generator, against `kestrel serve`: a synchronous profile on the chat endpoint
and a concurrent one on the completions endpoint, streaming, with synthetic prompts drawn from the model's own
tokenizer. Every request must succeed with the output length asked for, and the report must carry the latencies
only a stream gives (time to first token, inter-token latency)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .support import Served

REQUESTS = 12
OUTPUT_TOKENS = 16


def guidellm_run(served: Served, folder: Path, name: str, profile: str, request_format: str) -> dict[str, Any]:
    report = folder / f"{name}.json"
    command = [
        str(Path(sys.executable).with_name("guidellm")), "run",
        "--backend", f"kind=openai_http,target={served.base_url},model={served.model},api_key={served.api_key},"
                     f"request_format={request_format}",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={served.model_dir}",
        "--output", f"kind=json,path={report}",
        "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(folder / "hf-home"),
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=folder)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize(("profile", "request_format", "concurrency"), [
    ("kind=synchronous", "/v1/chat/completions", 1),
    ("kind=concurrent,streams=4", "/v1/completions", 4),
])
def test_every_request_succeeds_with_streamed_latencies(served: Served, tmp_path: Path, profile: str,
                                                        request_format: str, concurrency: int) -> None:
    report = guidellm_run(served, tmp_path, "report", profile, request_format)
    (benchmark,) = report["benchmarks"]
    assert benchmark["config"]["strategy"]["max_concurrency"] == concurrency
    requests = benchmark["requests"]
    assert len(requests["successful"]) == REQUESTS and not requests["errored"] and not requests["incomplete"]
    for request in requests["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] is True
        assert request["info"]["error"] is None
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        assert request["input_metrics"]["text_tokens"] >= 32
    metrics = benchmark["metrics"]
    # guidellm weighs inter-token latency by token: each request gives one for every token after its first
    for name, count in (("time_to_first_token_ms", REQUESTS), ("request_latency", REQUESTS),
                        ("inter_token_latency_ms", REQUESTS * (OUTPUT_TOKENS - 1))):
        successful = metrics[name]["successful"]
        # a stream whose consumer falls behind gets several tokens in one event, whose gaps are zero
        may_be_zero = name == "inter_token_latency_ms"
        assert successful["count"] == count and 0 <= successful["min"] <= successful["max"], name
        assert successful["max"] > 0 and (may_be_zero or successful["min"] > 0), name
    assert metrics["request_totals"]["successful"] == REQUESTS and metrics["request_totals"]["errored"] == 0
