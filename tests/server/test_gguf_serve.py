"""`kestrel serve FILE.gguf` in one command: kestrel-tiny's own weights written to a Q8_0 GGUF file (gguf's writer),
served by the CLI with nothing but the file; its completions are the offline engine's on the same file, and its
chat template is the one the file's metadata carries."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, MODEL, serve_process
from safetensors.torch import load_file

from kestrel import LLM, SamplingParams
from kestrel.tiny import default_model_path

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from kestrel.quant import gguf_export

    tiny = Path(default_model_path())
    tensors = ((name, t.float().numpy()) for name, t in load_file(str(tiny / "model.safetensors")).items())
    path = tmp_path_factory.mktemp("gguf") / "kestrel-tiny-Q8_0.gguf"
    return gguf_export.write_gguf(path, tiny, tensors, lambda name: "Q8_0")


def test_kestrel_serve_takes_a_gguf_file_alone(tiny_gguf: Path) -> None:
    prompt = "def fibonacci(n):"
    llm = LLM(str(tiny_gguf), dtype="float32")
    offline = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    template = llm.tokenizer.chat_template
    assert template, "the file's chat template"
    del llm
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with serve_process(str(tiny_gguf)) as (_, base):
        models = httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        served = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60).json()
        assert served["choices"][0]["text"] == offline.outputs[0].text
        assert served["usage"]["completion_tokens"] == 12
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                "temperature": 0.0}
        reply = httpx.post(f"{base}/v1/chat/completions", json=chat, headers=headers, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"
