"""The pooling runner's endpoints on live servers: a Qwen3 cross-encoder (Qwen3ForSequenceClassification, one label)
behind /score, /rerank, /pooling and /classify against transformers' logits, and a mean-pooling sentence-transformers
embedding model behind /v1/embeddings (the openai client) and /score by cosine; refusals are 400s naming the field."""

from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers
from conftest import API_KEY, MODEL, LiveServer
from http_client import HTTP

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_checkpoints import write_classifier, write_sentence_transformer  # noqa: E402

QUERY = "what is a fox"
DOCUMENTS = ["a fox is a small wild animal of the dog family", "use sorted(items) to sort a list",
             "Paris is the capital of France", "foxes live in dens"]


def _serve(path: Path, **engine_args) -> LiveServer:
    engine = AsyncEngine.from_args(str(path), max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16,
                                   device="cpu", dtype="float32", runner="pooling", **engine_args).start()
    return LiveServer(build_app(engine, MODEL, api_key=API_KEY, max_request_bytes=1 << 20), engine)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = write_classifier(tmp_path_factory.mktemp("qwen3-cross-encoder"), "qwen3", num_labels=1)
    server = _serve(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()

    def logit(first: str, second: str) -> float:
        with torch.inference_mode():
            return float(hf(torch.tensor([tokenizer(first, second)["input_ids"]])).logits[0, 0])

    yield server, logit
    server.stop()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = write_sentence_transformer(tmp_path_factory.mktemp("llama-mean-embedder"), "llama",
                                      "pooling_mode_mean_tokens", normalize=True)
    server = _serve(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def embed(text: str) -> np.ndarray:
        with torch.inference_mode():
            hidden = hf(torch.tensor([tokenizer.encode(text)]), output_hidden_states=True).hidden_states[-1][0]
        return torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1).numpy()

    yield server, embed
    server.stop()


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return HTTP.post(f"{server.base_url}{path}", headers=server.headers, json={"model": MODEL, **body}, timeout=60)


def _sigmoid(x: float) -> float:
    return 1 / (1 + np.exp(-x))


def test_score_is_the_sigmoid_of_the_cross_encoders_logit_in_every_pairing(cross_encoder):
    server, logit = cross_encoder
    one = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]}).json()
    assert one["object"] == "list" and one["model"] == MODEL and one["id"]
    assert [d["object"] for d in one["data"]] == ["score"] and one["data"][0]["index"] == 0
    assert one["data"][0]["score"] == pytest.approx(_sigmoid(logit(QUERY, DOCUMENTS[0])), abs=1e-4)
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] > 0
    many = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in many["data"]] == pytest.approx(
        [_sigmoid(logit(QUERY, d)) for d in DOCUMENTS], abs=1e-4)
    firsts = ["a", "b", "c", "d"]
    paired = _post(server, "/score", {"text_1": firsts, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in paired["data"]] == pytest.approx(
        [_sigmoid(logit(a, b)) for a, b in zip(firsts, DOCUMENTS)], abs=1e-4)


def test_rerank_sorts_by_score_on_every_path(cross_encoder):
    server, logit = cross_encoder
    want = sorted(((_sigmoid(logit(QUERY, d)), i) for i, d in enumerate(DOCUMENTS)), reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = _post(server, path, {"query": QUERY, "documents": DOCUMENTS}).json()
        assert reply["model"] == MODEL and reply["usage"]["total_tokens"] > 0 and reply["id"]
        assert [r["index"] for r in reply["results"]] == [i for _, i in want]
        assert [r["relevance_score"] for r in reply["results"]] == pytest.approx([s for s, _ in want], abs=1e-4)
        assert [r["document"]["text"] for r in reply["results"]] == [DOCUMENTS[i] for _, i in want]
    top = _post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                    "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == [i for _, i in want[:2]]
    assert all("document" not in r for r in top["results"])


def test_pooling_returns_the_logits_and_classify_their_probability(cross_encoder):
    server, logit = cross_encoder
    texts = ["first input text", "second"]
    pooled = _post(server, "/pooling", {"input": texts}).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    classified = _post(server, "/classify", {"input": texts}).json()
    for text, pooled_row, class_row in zip(texts, pooled["data"], classified["data"]):
        assert pooled_row["data"] == pytest.approx([logit(text, None)], abs=1e-4)
        assert class_row["num_classes"] == 1 and class_row["label"] == "LABEL_0"
        assert class_row["probs"][0] == pytest.approx(_sigmoid(pooled_row["data"][0]), abs=1e-6)


def test_concurrent_requests_batch_and_match_one_at_a_time(cross_encoder):
    server, _ = cross_encoder
    alone = [_post(server, "/score", {"text_1": QUERY, "text_2": d}).json()["data"][0]["score"] for d in DOCUMENTS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda d: _post(server, "/score", {"text_1": QUERY, "text_2": d}).json(),
                                 DOCUMENTS * 2))
    assert [r["data"][0]["score"] for r in together] == pytest.approx(alone * 2, abs=1e-5)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["word " * 200]}, "documents"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_1": QUERY}, "text_2"),
    ("/score", {"text_1": QUERY, "text_2": "x", "normalize": True}, "normalize"),
    ("/pooling", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "text"}, "model"),
])
def test_refusals_are_openai_errors_naming_the_field(cross_encoder, path, body, param):
    server, _ = cross_encoder
    reply = _post(server, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_generation_on_a_pooling_server_is_refused_naming_the_runner(cross_encoder):
    server, _ = cross_encoder
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        reply = _post(server, path, body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "model" and "pooling runner" in reply.json()["error"]["message"]


def test_openai_embeddings_pool_the_mean_as_the_checkpoint_says(embedder):
    server, embed = embedder
    client = server.client()
    texts = ["The quick brown fox jumps over the lazy dog again and again", "Hello there", "a"]
    reply = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for data, text in zip(reply.data, texts):
        assert np.allclose(data.embedding, embed(text), atol=1e-4)
    decoded = client.embeddings.create(model=MODEL, input=texts)  # base64, decoded by the client
    assert all(np.allclose(a.embedding, b.embedding) for a, b in zip(reply.data, decoded.data))


def test_score_and_rerank_of_an_embedding_model_are_cosine_similarities(embedder):
    server, embed = embedder
    scores = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    want = [float(np.dot(embed(QUERY), embed(d))) for d in DOCUMENTS]
    assert [d["score"] for d in scores["data"]] == pytest.approx(want, abs=1e-4)
    ranked = _post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 1}).json()
    assert ranked["results"][0]["index"] == int(np.argmax(want))
    refused = _post(server, "/classify", {"input": "x"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_embeddings_of_chat_messages_pool_the_rendered_conversation(embedder):
    """vLLM's chat form of /v1/embeddings: the messages rendered by the chat template (no generation prompt by
    default) are embedded as that token sequence would be."""
    server, _ = embedder
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is a fox"}]
    for generation_prompt in (False, True):
        tokens = _post(server, "/tokenize", {"messages": messages,
                                             "add_generation_prompt": generation_prompt}).json()["tokens"]
        body = {"messages": messages, **({"add_generation_prompt": True} if generation_prompt else {})}
        chat = _post(server, "/v1/embeddings", body)
        assert chat.status_code == 200, chat.text
        by_ids = _post(server, "/v1/embeddings", {"input": tokens}).json()
        assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
        assert np.allclose(chat.json()["data"][0]["embedding"], by_ids["data"][0]["embedding"], atol=1e-6)
    cut = _post(server, "/v1/embeddings", {"messages": messages, "truncate_prompt_tokens": 3}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    for body, param in (({"messages": messages, "chat_template": "{{ messages }}"}, "chat_template"),
                        ({"messages": []}, "messages"),
                        ({"messages": messages, "input": "x"}, None)):
        reply = _post(server, "/v1/embeddings", body)
        assert reply.status_code == 400, reply.text
        assert param is None or reply.json()["error"]["param"] == param
