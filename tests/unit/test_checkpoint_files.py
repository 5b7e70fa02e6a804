"""Checkpoint files as vLLM users have them: PyTorch `pytorch_model*.bin` (single and sharded, read with
weights_only=True) give the same model as safetensors, and a Hugging Face model id resolves offline from a local
hub cache (refs/main's snapshot), with a clear error when it is not there."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError, EngineConfig
from kestrel.loader.model_init import write_tiny_checkpoint

PROMPT = {"prompt_token_ids": [3, 4, 5, 6]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("files")
    write_tiny_checkpoint(str(path), arch="llama", seed=5)
    return path


def tokens(path, **kwargs) -> list[int]:
    llm = LLM(str(path), dtype="float32", max_model_len=64, **kwargs)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def as_pytorch_bin(model_dir, out, shards: int):
    shutil.copytree(model_dir, out)
    state = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(state)
    if shards == 1:
        torch.save(state, out / "pytorch_model.bin")
        return out
    weight_map = {}
    for i in range(shards):
        part = {n: state[n] for n in names[i::shards]}
        filename = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save(part, out / filename)
        weight_map.update(dict.fromkeys(part, filename))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.mark.parametrize("shards", [1, 3])
def test_pytorch_bin_checkpoints_load_like_safetensors(model_dir, tmp_path, shards):
    expected = tokens(model_dir)
    assert tokens(as_pytorch_bin(model_dir, tmp_path / "bin", shards)) == expected


def test_a_model_id_resolves_from_the_local_hub_cache(model_dir, tmp_path):
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    config = EngineConfig.from_kwargs("acme/tiny", download_dir=str(tmp_path / "hub"))
    assert config.model.model == str(repo / "snapshots" / "0123abc")
    assert tokens("acme/tiny", download_dir=str(tmp_path / "hub")) == tokens(model_dir)
    with pytest.raises(ConfigError, match="no snapshot of the Hugging Face model 'acme/other'"):
        EngineConfig.from_kwargs("acme/other", download_dir=str(tmp_path / "hub"))
