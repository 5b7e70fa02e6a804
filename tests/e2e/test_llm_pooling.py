"""The offline pooling API (`LLM.embed`, `classify`, `score`, `encode`) on tiny random checkpoints transformers
writes (float32): embeddings equal to transformers' pooled hidden states and to what /v1/embeddings' recipe makes on
the engine, label probabilities equal to the softmax of transformers' logits, cross-encoder scores equal to the
sigmoid of its logit, bi-encoder scores equal to the cosine of transformers' embeddings; refusals name the argument."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kestrel import (
    LLM,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    SamplingParams,
    ScoringRequestOutput,
)
from kestrel.entrypoints.engine_factory import build_engine, engine_config
from kestrel.entrypoints.pooling_tasks import checked_dimensions, embedding_params
from kestrel.request import InvalidRequestError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_checkpoints import write_classifier, write_sentence_transformer  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the woods",
         "The quick brown fox jumps over the lazy dog, and then it sleeps", "Hello there", "a"]
QUERY = "what is a fox"
DOCUMENTS = ["a fox is a small wild animal of the dog family", "use sorted(items) to sort a list",
             "Paris is the capital of France"]
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 16,
          "max_num_seqs": 4}
ATOL = 1e-4


def _hidden(path: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def _close(got: list[float], want: torch.Tensor) -> bool:
    return len(got) == want.numel() and torch.allclose(torch.tensor(got), want, atol=ATOL)


@pytest.fixture(scope="module")
def last_model(tmp_path_factory):
    """Qwen3, last-token pooling, normalized; config.json names the Matryoshka sizes it was trained for."""
    path = write_sentence_transformer(tmp_path_factory.mktemp("qwen3-last"), "qwen3", "pooling_mode_lasttoken",
                                      normalize=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    return path, LLM(str(path), runner="pooling", **ENGINE)


@pytest.fixture(scope="module")
def mean_model(tmp_path_factory):
    path = write_sentence_transformer(tmp_path_factory.mktemp("llama-mean"), "llama", "pooling_mode_mean_tokens",
                                      normalize=True)
    return path, LLM(str(path), runner="pooling", **ENGINE)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = write_classifier(tmp_path_factory.mktemp("qwen2-cross"), "qwen2", num_labels=1)
    return path, LLM(str(path), **ENGINE)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = write_classifier(tmp_path_factory.mktemp("llama-3-labels"), "llama", num_labels=3, seed=1)
    return path, LLM(str(path), **ENGINE)


@pytest.mark.parametrize(("model", "pool"), [("last_model", lambda h: h[-1]), ("mean_model", lambda h: h.mean(0))])
def test_embed_equals_transformers_pooled_and_normalized(request, model, pool):
    path, llm = request.getfixturevalue(model)
    tokenizer = llm.get_tokenizer()
    outputs = llm.embed(TEXTS, use_tqdm=False)
    assert [type(o) for o in outputs] == [EmbeddingRequestOutput] * len(TEXTS)
    for text, output in zip(TEXTS, outputs):
        ids = tokenizer.encode(text)
        assert output.prompt_token_ids == ids and output.finished and output.outputs.hidden_size == 64
        want = torch.nn.functional.normalize(pool(_hidden(path, ids)), dim=-1)
        assert _close(output.outputs.embedding, want), text
    assert len({o.request_id for o in outputs}) == len(TEXTS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        outputs[0].outputs.embedding = []  # type: ignore[misc]


def test_embed_equals_the_embeddings_endpoints_recipe_on_the_engine(last_model):
    """/v1/embeddings pools with `embedding_params` (the model's pooler settings, checked `dimensions`) through
    EngineCore.add_request; the same inputs through LLM.embed give the same vectors."""
    path, llm = last_model
    config = engine_config(str(path), runner="pooling", **ENGINE)
    core = build_engine(config).core
    for dimensions in (None, 32):
        params = embedding_params(config.model, checked_dimensions(config.model.hf_config, dimensions))
        for i, text in enumerate(TEXTS):
            core.add_request(f"{dimensions}-{i}", llm.get_tokenizer().encode(text), params)
        served: dict[str, list[float]] = {}
        while core.has_unfinished_requests():
            served.update({o.request_id: o.pooled for o in core.step() if o.finished})
        offline = llm.embed(TEXTS, PoolingParams(dimensions=dimensions), use_tqdm=False)
        for i, output in enumerate(offline):
            assert _close(output.outputs.embedding, torch.tensor(served[f"{dimensions}-{i}"]))


def test_pooling_params_dimensions_and_normalize_are_honoured(last_model, mean_model):
    path, llm = last_model
    ids = llm.get_tokenizer().encode(TEXTS[0])
    last = _hidden(path, ids)[-1]
    short = llm.embed(TEXTS[0], PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.embedding
    assert _close(short, torch.nn.functional.normalize(last[:32], dim=-1))
    raw = llm.embed(TEXTS[0], PoolingParams(dimensions=16, normalize=False), use_tqdm=False)[0].outputs.embedding
    assert _close(raw, last[:16])
    # Left None, the pooling type stays the model's (mean here), with only normalize changed.
    mean_path, mean_llm = mean_model
    ids = mean_llm.get_tokenizer().encode(TEXTS[1])
    got = mean_llm.embed([TEXTS[1]], [PoolingParams(normalize=False)], use_tqdm=False)[0].outputs.embedding
    assert _close(got, _hidden(mean_path, ids).mean(0))
    with pytest.raises(InvalidRequestError, match=r"pooling_params\.dimensions=48 is not one this model was "
                       r"trained for: \[16, 32, 64\]") as error:
        llm.embed(TEXTS[0], PoolingParams(dimensions=48))
    assert error.value.param == "pooling_params.dimensions"
    with pytest.raises(InvalidRequestError, match=r"pooling_params\.dimensions=32: this model does not support "
                       "Matryoshka"):
        mean_llm.embed(TEXTS[0], PoolingParams(dimensions=32))


def test_truncate_prompt_tokens_keeps_the_last_tokens(last_model):
    path, llm = last_model
    ids = llm.get_tokenizer().encode(TEXTS[0])
    output = llm.embed(TEXTS[0], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert output.prompt_token_ids == ids[-5:]
    assert _close(output.outputs.embedding, torch.nn.functional.normalize(_hidden(path, ids[-5:])[-1], dim=-1))


@pytest.mark.parametrize("model", ["last_model", "mean_model"])
def test_a_prompt_may_fill_the_context(request, model):
    """A pooled prompt generates nothing, so it may hold max_model_len tokens (a generated one needs one less)."""
    path, llm = request.getfixturevalue(model)
    ids = [(7 * i) % 500 + 3 for i in range(ENGINE["max_model_len"])]
    (output,) = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    hidden = _hidden(path, ids)
    want = hidden[-1] if model == "last_model" else hidden.mean(0)
    assert _close(output.outputs.embedding, torch.nn.functional.normalize(want, dim=-1))
    with pytest.raises(ValueError, match=f"at most {ENGINE['max_model_len']} tokens"):
        llm.embed([{"prompt_token_ids": [*ids, 3]}], use_tqdm=False)
    # truncate_prompt_tokens up to max_model_len, and vLLM's -1 (max_model_len), keep the last tokens
    for truncate in (ENGINE["max_model_len"], -1):
        (kept,) = llm.embed([{"prompt_token_ids": [3, *ids]}], truncate_prompt_tokens=truncate, use_tqdm=False)
        assert kept.prompt_token_ids == ids and kept.outputs.embedding == output.outputs.embedding


def test_a_generation_model_embeds_by_last_token_normalized_and_a_pooling_one_does_not_generate(last_model):
    path, pooling_llm = last_model
    llm = LLM(str(path), **ENGINE)  # runner auto: a causal LM generates
    assert llm.config.model.runner == "generate"
    ids = llm.get_tokenizer().encode(TEXTS[2])
    embedding = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
    assert _close(embedding, torch.nn.functional.normalize(_hidden(path, ids)[-1], dim=-1))
    assert len(llm.generate(TEXTS[2], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    with pytest.raises(InvalidRequestError, match=r"pooling runner \(runner='pooling'.*does not generate"):
        pooling_llm.generate(TEXTS[2], SamplingParams(max_tokens=2))


def test_classify_probs_equal_softmax_of_transformers_logits(classifier):
    path, llm = classifier
    tokenizer = llm.get_tokenizer()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    outputs = llm.classify(TEXTS, use_tqdm=False)
    assert [type(o) for o in outputs] == [ClassificationRequestOutput] * len(TEXTS)
    for text, output in zip(TEXTS, outputs):
        with torch.inference_mode():
            logits = hf(torch.tensor([tokenizer.encode(text)])).logits[0]
        assert output.outputs.num_classes == 3
        assert _close(output.outputs.probs, torch.softmax(logits, dim=-1)), text
        raw = llm.encode(text, use_tqdm=False)[0].outputs.data
        assert _close(raw, logits)
        assert _close(llm.encode(text, pooling_task="classify", use_tqdm=False)[0].outputs.data,
                      torch.tensor(output.outputs.probs))


def test_cross_encoder_scores_are_the_sigmoid_of_its_logit_one_to_n_and_n_to_n(cross_encoder):
    path, llm = cross_encoder
    tokenizer = llm.get_tokenizer()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()

    def want(first: str, second: str) -> torch.Tensor:
        with torch.inference_mode():
            return torch.sigmoid(hf(torch.tensor([tokenizer(first, second)["input_ids"]])).logits[0])

    one_to_n = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert [type(o) for o in one_to_n] == [ScoringRequestOutput] * len(DOCUMENTS)
    for document, output in zip(DOCUMENTS, one_to_n):
        assert output.prompt_token_ids == tokenizer(QUERY, document)["input_ids"]
        assert _close([output.outputs.score], want(QUERY, document))
    firsts = [QUERY, {"prompt": "sorting"}, "france"]
    n_to_n = llm.score(firsts, DOCUMENTS, use_tqdm=False)
    for first, document, output in zip(["what is a fox", "sorting", "france"], DOCUMENTS, n_to_n):
        assert _close([output.outputs.score], want(first, document))
    assert [o.outputs.score for o in llm.score([QUERY], DOCUMENTS[0], use_tqdm=False)] == [one_to_n[0].outputs.score]
    with pytest.raises(InvalidRequestError, match="data_1 has 2 texts and data_2 has 3") as error:
        llm.score([QUERY, QUERY], DOCUMENTS)
    assert error.value.param == "data_2"
    with pytest.raises(InvalidRequestError, match="data_1: a cross-encoder scores text pairs"):
        llm.score({"prompt_token_ids": [5, 6]}, DOCUMENTS)


def test_embedding_model_scores_are_cosine_similarities(mean_model):
    path, llm = mean_model
    tokenizer = llm.get_tokenizer()

    def embedding(text: str) -> torch.Tensor:
        return _hidden(path, tokenizer.encode(text)).mean(0)

    for firsts in (QUERY, [QUERY, DOCUMENTS[1], "france"]):
        outputs = llm.score(firsts, DOCUMENTS, use_tqdm=False)
        pairs = zip([firsts] * 3 if isinstance(firsts, str) else firsts, DOCUMENTS)
        for (first, second), output in zip(pairs, outputs):
            want = torch.nn.functional.cosine_similarity(embedding(first), embedding(second), dim=0)
            assert abs(output.outputs.score - float(want)) < ATOL
            assert output.prompt_token_ids == tokenizer.encode(first) + tokenizer.encode(second)
    # The same text on both sides scores 1.
    assert abs(llm.score(QUERY, QUERY, use_tqdm=False)[0].outputs.score - 1.0) < 1e-5


def test_each_task_on_the_wrong_model_is_refused_naming_the_model(last_model, classifier):
    _, embedder = last_model
    _, labels = classifier
    with pytest.raises(InvalidRequestError, match=r"LlamaForSequenceClassification is a classifier: it has no "
                       r"embeddings for LLM\.embed") as error:
        labels.embed("hello")
    assert error.value.param == "model"
    # Three labels: scoring (one label) is not offered as the way out.
    assert "LLM.score" not in str(error.value) and "use LLM.classify or LLM.encode" in str(error.value)
    with pytest.raises(InvalidRequestError, match=r"Qwen3ForCausalLM is not a classifier \(an embedding model "
                       r"under the pooling runner\): LLM\.classify needs a \*ForSequenceClassification"):
        embedder.classify("hello")
    with pytest.raises(InvalidRequestError, match="has 3 labels; scoring needs a cross-encoder with one"):
        labels.score(QUERY, DOCUMENTS)


@pytest.mark.parametrize(("call", "param", "match"), [
    (lambda e, c: e.embed(TEXTS, truncate_prompt_tokens=0), "truncate_prompt_tokens", "truncate_prompt_tokens=0"),
    (lambda e, c: e.embed(TEXTS, truncate_prompt_tokens=129), "truncate_prompt_tokens", "more than max_model_len"),
    (lambda e, c: e.embed(TEXTS, truncate_prompt_tokens=-2), "truncate_prompt_tokens", "-1 for max_model_len"),
    (lambda e, c: e.embed(TEXTS, lora_request=object()), "lora_request", "LoRA adapters"),
    (lambda e, c: e.embed(TEXTS, [PoolingParams()] * 2), "pooling_params", "got 2 pooling_params for 4 prompts"),
    (lambda e, c: e.embed(TEXTS, SamplingParams()), "pooling_params", "must be a PoolingParams"),
    (lambda e, c: e.score(QUERY, DOCUMENTS, pooling_params=[PoolingParams()]), "pooling_params", "one PoolingParams"),
    (lambda e, c: e.encode(TEXTS, pooling_task="token_embed"), "pooling_task", "pooling_task='token_embed'"),
    (lambda e, c: c.classify(TEXTS, PoolingParams(dimensions=2)), "pooling_params.dimensions",
     "label logits, which cannot be truncated"),
    (lambda e, c: c.classify(TEXTS, PoolingParams(normalize=True)), "pooling_params.normalize",
     "pooling_params.normalize=True"),
    (lambda e, c: c.score(QUERY, DOCUMENTS, lora_request=object()), "lora_request", "LoRA adapters"),
])
def test_arguments_are_refused_by_name(last_model, cross_encoder, call, param, match):
    with pytest.raises(InvalidRequestError, match=match) as error:
        call(last_model[1], cross_encoder[1])
    assert error.value.param == param
    assert not last_model[1].engine.has_unfinished_requests()


def test_encode_embed_task_returns_the_embedding(mean_model):
    _, llm = mean_model
    encoded = llm.encode(TEXTS[:2], pooling_task="embed", use_tqdm=False)
    embedded = llm.embed(TEXTS[:2], use_tqdm=False)
    default = llm.encode(TEXTS[:2], use_tqdm=False)
    for got, again, want in zip(encoded, default, embedded):
        assert _close(got.outputs.data, torch.tensor(want.outputs.embedding))
        assert _close(again.outputs.data, torch.tensor(want.outputs.embedding))
