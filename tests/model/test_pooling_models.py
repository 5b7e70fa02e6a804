"""The pooling runner against transformers on tiny random checkpoints transformers writes (float32): sequence
classifiers' logits (Llama, Qwen2, Qwen3), and embeddings pooled at the last token, the mean of the prompt or the
first token, under chunked prefill, prefix caching and batching; the checkpoint's sentence-transformers files and
--pooler-config deciding the pooling; what the config refuses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kestrel.config import ConfigError, EngineConfig
from kestrel.entrypoints.cli import _engine_kwargs, build_parser
from kestrel.entrypoints.engine_factory import build_engine, engine_config
from kestrel.pooling_params import PoolingParams
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_checkpoints import write_classifier, write_sentence_transformer  # noqa: E402

PAIRS = [("what is a fox", "a fox is a small wild animal of the dog family"),
         ("how do I sort a list in python", "use sorted(items) or items.sort()"),
         ("capital of france", "Paris is the capital and largest city of France, on the Seine"),
         ("x", "y")]
TEXTS = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the woods",
         "The quick brown fox jumps over the lazy dog, and then it sleeps",
         "Hello there", "a"]


def run_engine(model_dir: Path, prompts: list[list[int]], params: PoolingParams,
               **engine_args) -> tuple[list[list[float]], object]:
    """Every prompt added at once (one batch), stepped to the end; (pooled outputs in order, the engine core)."""
    config = engine_config(str(model_dir), device="cpu", dtype="float32", max_model_len=256, **engine_args)
    core = build_engine(config).core
    for i, ids in enumerate(prompts):
        core.add_request(str(i), ids, params)
    pooled: dict[str, list[float]] = {}
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                pooled[output.request_id] = output.pooled
    return [pooled[str(i)] for i in range(len(prompts))], core


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_sequence_classifier_logits_equal_transformers(tmp_path, family):
    path = write_classifier(tmp_path / family, family, num_labels=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [tokenizer(a, b)["input_ids"] for a, b in PAIRS]
    # 8-token steps: the longer pairs are prefilled in chunks, all four in the same steps.
    ours, core = run_engine(path, prompts, PoolingParams(normalize=False), max_num_batched_tokens=8, max_num_seqs=4)
    assert core.config.model.runner == "pooling" and core.config.model.pooler.num_labels == 3
    for ids, vector in zip(prompts, ours):
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0]
        assert torch.allclose(torch.tensor(vector), want, atol=1e-4), (vector, want)


def _hf_hidden(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


POOLED = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(dim=0), "CLS": lambda h: h[0]}


@pytest.mark.parametrize(("family", "mode", "pooling_type"), [
    ("qwen3", "pooling_mode_lasttoken", "LAST"), ("llama", "pooling_mode_mean_tokens", "MEAN"),
    ("qwen2", "pooling_mode_cls_token", "CLS")])
def test_embeddings_pool_as_the_checkpoint_says_under_chunks_prefix_caching_and_batching(tmp_path, family, mode,
                                                                                         pooling_type):
    path = write_sentence_transformer(tmp_path / family, family, mode, normalize=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    prompts = [tokenizer.encode(text) for text in TEXTS]
    config = engine_config(str(path), device="cpu", dtype="float32", max_model_len=256, runner="pooling",
                           max_num_batched_tokens=8, max_num_seqs=4)
    pooler = config.model.pooler
    assert (pooler.task, pooler.pooling_type, pooler.normalize, pooler.source) == (
        "embed", pooling_type, True, "modules.json")
    params = PoolingParams(normalize=True, pooling_type=pooling_type)
    core = build_engine(config).core
    # The first prompt, computed once, fills the prefix cache that the second (sharing 16+ tokens) may hit.
    core.add_request("warm", prompts[0], params)
    while core.has_unfinished_requests():
        core.step()
    for i, ids in enumerate(prompts):
        core.add_request(str(i), ids, params)
    pooled, cached = {}, {}
    requests = {str(i): core.scheduler.waiting[i] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                pooled[output.request_id] = output.pooled
    for rid, request in requests.items():
        cached[rid] = request.num_cached_tokens
    # LAST pooling reads cached prefixes; MEAN and CLS recompute every prompt token (a cached block has no
    # hidden states).
    if pooling_type == "LAST":
        assert cached["0"] > 0 and cached["1"] > 0
    else:
        assert all(count == 0 for count in cached.values()), cached
    for i, ids in enumerate(prompts):
        want = torch.nn.functional.normalize(POOLED[pooling_type](_hf_hidden(path, ids)), dim=-1)
        assert torch.allclose(torch.tensor(pooled[str(i)]), want, atol=1e-4), i


def test_pooler_config_overrides_the_checkpoint_and_unnormalized_mean_matches(tmp_path):
    path = write_sentence_transformer(tmp_path / "st", "llama", "pooling_mode_lasttoken", normalize=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    args = build_parser().parse_args(["serve", str(path), "--runner", "pooling", "--pooler-config",
                                      '{"pooling_type": "MEAN", "normalize": false}'])
    kwargs = _engine_kwargs(args)
    assert kwargs == {"runner": "pooling", "pooler_config": {"pooling_type": "MEAN", "normalize": False}}
    pooler = EngineConfig.from_kwargs(str(path), **kwargs).model.pooler
    assert (pooler.pooling_type, pooler.normalize, pooler.source) == ("MEAN", False, "pooler_config")
    vllm_spelling = EngineConfig.from_kwargs(str(path), runner="pooling",
                                             override_pooler_config={"pooling_type": "MEAN", "normalize": False})
    assert vllm_spelling.model.pooler == pooler
    ids = tokenizer.encode(TEXTS[0])
    ours, _ = run_engine(path, [ids], PoolingParams(normalize=False, pooling_type="MEAN"), runner="pooling",
                         max_num_batched_tokens=8, max_num_seqs=2)
    assert torch.allclose(torch.tensor(ours[0]), _hf_hidden(path, ids).mean(dim=0), atol=1e-4)


def test_a_decoder_without_sentence_transformers_files_embeds_by_last_token_normalized(tmp_path):
    path = write_sentence_transformer(tmp_path / "plain", "qwen3", "pooling_mode_lasttoken", normalize=False)
    (path / "modules.json").unlink()
    pooler = EngineConfig.from_kwargs(str(path), runner="pooling").model.pooler
    assert (pooler.task, pooler.pooling_type, pooler.normalize, pooler.source) == ("embed", "LAST", True, "default")
    assert EngineConfig.from_kwargs(str(path)).model.runner == "generate"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"runner": "pooling", "pooler_config": {"pooling_type": "MAX"}}, r"pooler_config\.pooling_type='MAX'"),
    ({"runner": "pooling", "pooler_config": {"softmax": True}}, r"pooler_config\.softmax"),
    ({"runner": "pooling", "pooler_config": {"normalize": "yes"}}, r"pooler_config\.normalize"),
    ({"pooler_config": {"pooling_type": "MEAN"}}, r"pooler_config=.*runner='pooling'"),
    ({"runner": "embed"}, r"runner='embed'"),
    ({"task": "embed"}, r"task='embed' is not supported.*runner='pooling'"),
])
def test_pooling_settings_are_refused_by_name(tmp_path, kwargs, match):
    path = write_sentence_transformer(tmp_path / "st", "llama", "pooling_mode_mean_tokens", normalize=True)
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(str(path), **kwargs)


def test_unsupported_sentence_transformers_layouts_are_refused(tmp_path):
    path = write_sentence_transformer(tmp_path / "st", "llama", "pooling_mode_max_tokens", normalize=False)
    with pytest.raises(ConfigError, match=r"pooling_mode_max_tokens.*--pooler-config"):
        EngineConfig.from_kwargs(str(path), runner="pooling")
    # --pooler-config cannot stand in for a module kestrel does not run.
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match=r"sentence_transformers\.models\.Dense"):
        EngineConfig.from_kwargs(str(path), runner="pooling", pooler_config={"pooling_type": "MEAN"})


def test_a_classifier_cannot_generate_nor_normalize(tmp_path):
    path = write_classifier(tmp_path / "cls", "qwen2")
    with pytest.raises(ConfigError, match=r"runner='generate'.*Qwen2ForSequenceClassification.*--runner pooling"):
        EngineConfig.from_kwargs(str(path), runner="generate")
    with pytest.raises(ConfigError, match=r"pooler_config\.normalize=True"):
        EngineConfig.from_kwargs(str(path), pooler_config={"normalize": True})
    core = build_engine(engine_config(str(path), device="cpu", dtype="float32", max_model_len=64)).core
    with pytest.raises(InvalidRequestError, match="pooling runner.*does not generate"):
        core.add_request("g", [1, 5, 6], SamplingParams(max_tokens=2))


def test_pooler_config_stands_in_for_a_pooling_mode_kestrel_lacks(tmp_path):
    path = write_sentence_transformer(tmp_path / "st", "llama", "pooling_mode_max_tokens", normalize=True)
    pooler = EngineConfig.from_kwargs(str(path), runner="pooling", pooler_config={"pooling_type": "MEAN"}).model.pooler
    assert (pooler.pooling_type, pooler.normalize) == ("MEAN", True)
