"""/v1/embeddings on the tiny random Llama served for generation: last-token pooling of the final hidden state,
L2-normalized, against transformers, through the official `openai` client."""

import base64

import numpy as np
import openai
import pytest
import torch
import transformers
from http_client import HTTP

MODEL = "tiny"
TEXTS = ["The quick brown fox", "Hello there, how are you today?", "a"]


@pytest.fixture(scope="module")
def client(openai_server) -> openai.OpenAI:
    return openai_server.client()


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    """The last token's hidden state after the final norm (transformers' last hidden state), L2-normalized."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()

    return tokenizer, embed


def test_embeddings_match_transformers_in_every_input_shape(client, oracle):
    tokenizer, embed = oracle
    ids = [tokenizer.encode(text) for text in TEXTS]
    expected = [embed(i) for i in ids]
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == MODEL and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0
    assert np.allclose(one.data[0].embedding, expected[0], atol=1e-5)
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])
    batch = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    for data, want in zip(batch.data, expected):
        assert np.linalg.norm(data.embedding) == pytest.approx(1.0, abs=1e-5)
        assert np.allclose(data.embedding, want, atol=1e-5)
    assert batch.usage.prompt_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, expected[1], atol=1e-5)
    by_id_lists = client.embeddings.create(model=MODEL, input=ids[:2], encoding_format="float")
    assert all(np.allclose(d.embedding, w, atol=1e-5) for d, w in zip(by_id_lists.data, expected))


def test_base64_round_trip(client, openai_server):
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert all(np.array_equal(np.float32(a.embedding), np.float32(b.embedding))
               for a, b in zip(floats.data, decoded.data))
    raw = HTTP.post(f"{openai_server.base_url}/v1/embeddings", headers=openai_server.headers,
                    json={"model": MODEL, "input": TEXTS, "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(vector, np.float32(floats.data[0].embedding))


@pytest.mark.parametrize(("body", "param"), [
    ({"input": TEXTS[0], "dimensions": 16}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": "", "add_special_tokens": False}, "input"),
    ({"input": TEXTS[0], "encoding_format": "int8"}, "encoding_format"),
    ({"input": TEXTS[0], "normalize": False}, "normalize"),
    ({"input": [[1, 2], "text"]}, "input"),
])
def test_refusals_name_the_field(openai_server, body, param):
    reply = HTTP.post(f"{openai_server.base_url}/v1/embeddings", headers=openai_server.headers,
                      json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_an_input_may_fill_the_context(client, openai_server, oracle):
    """An embedded input generates nothing: it may hold max_model_len tokens; one more is a 400."""
    _, embed = oracle
    limit = openai_server.engine.max_model_len
    ids = [(7 * i) % 500 + 3 for i in range(limit)]
    (data,) = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float").data
    assert np.allclose(data.embedding, embed(ids), atol=1e-4)
    reply = HTTP.post(f"{openai_server.base_url}/v1/embeddings", headers=openai_server.headers,
                      json={"model": MODEL, "input": [[*ids, 3]]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    assert f"at most {limit} tokens" in reply.json()["error"]["message"]


def test_engine_pools_unnormalized_and_truncated(openai_server, oracle):
    """PoolingParams on the engine: Matryoshka truncation before the (optional) normalization."""
    import asyncio

    from kestrel.pooling_params import PoolingParams

    tokenizer, _ = oracle
    model = transformers.AutoModelForCausalLM.from_pretrained(openai_server.engine.model_path,
                                                              dtype=torch.float32).eval()
    ids = tokenizer.encode(TEXTS[1])
    with torch.inference_mode():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]

    async def pooled(params: PoolingParams) -> list[float]:
        stream = openai_server.engine.submit(f"pool-{params}", ids, params)
        return [output async for output in stream][-1].pooled

    raw, short = asyncio.run(_both(pooled, PoolingParams(normalize=False), PoolingParams(dimensions=8)))
    assert np.allclose(raw, hidden.numpy(), atol=1e-5)
    assert len(short) == 8 and np.allclose(short, torch.nn.functional.normalize(hidden[:8], dim=-1), atol=1e-5)


async def _both(run, first, second):
    return await run(first), await run(second)


def test_embeddings_generate_no_tokens_in_the_metrics(client, openai_server):
    """A pooled request's result is its hidden state: /metrics counts its prompt and a success finished "stop",
    and no generated token (each used to count one, finished "length")."""
    import re

    def series() -> dict[str, float]:
        text = HTTP.get(f"{openai_server.base_url}/metrics", headers=openai_server.headers).text
        found = {}
        for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
            found[name] = sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))
        for reason in ("stop", "length"):
            found[reason] = sum(float(v) for v in re.findall(
                rf'^vllm:request_success_total{{[^}}]*finished_reason="{reason}"[^}}]*}} (\S+)$', text, re.M))
        return found

    openai_server.wait_idle()
    before = series()
    reply = client.embeddings.create(model=MODEL, input=TEXTS)
    openai_server.wait_idle()
    after = series()
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"]
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == reply.usage.prompt_tokens
    assert (after["stop"] - before["stop"], after["length"] - before["length"]) == (len(TEXTS), 0)
